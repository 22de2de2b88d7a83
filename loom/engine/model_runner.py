"""Model runner: turns a scheduled batch into tensors, runs the model, samples.

For each scheduled sequence it packs the tokens it computes this step (ids, positions, the
slot of each token in the paged pool) and describes its attention: decode rows by padded block
tables and context lengths, prefill chunks as segments. Rows whose sequence reaches its last
token this step are sampled; a request asking for prompt logprobs also gets the logits of its
prompt rows.
"""
from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom.engine.scheduler import ScheduledBatch
from loom.engine.sequence import Sequence
from loom.kv.attention import AttentionMetadata, PrefillSegment
from loom.kv.cache import KVCache
from loom.kv.swap import SwapSpace
from loom.layers.sampler import Sampler, SampleResult, SampleRow, top_logprobs
from loom.models.llama import LlamaForCausalLM
from loom.outputs import Logprob


@dataclass
class SeqStepOutput:
    sample: SampleResult | None = None    # None while the sequence is mid-prompt
    # (position, {token: Logprob}) for the prompt tokens this step scored
    prompt_logprobs: list[tuple[int, dict[int, Logprob]]] | None = None


_engine_ids = itertools.count()


def _private_forward(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """`model.forward` over a code object of its own. Dynamo keeps compiled graphs per code
    object; with guards on modules skipped, a graph cached on the shared forward could serve
    another engine's model with this one's weights. The name is its own too: Dynamo keeps what
    it learned about sizes per (file, line, name), and would otherwise treat the sizes in which
    two engines' models differ (an int8 and an int4 model's weights) as dynamic, passing ~200
    of them into every step of the engine compiled later (measured: 1 ms more per step)."""
    f = model.forward.__func__
    code = f.__code__.replace(co_name=f"{f.__name__}_engine{next(_engine_ids)}")
    return types.MethodType(types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__), model)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, sampler: Sampler, device: torch.device,
                 eos_token_ids: set[int], swap_space: SwapSpace | None = None, compile_decode: bool = False) -> None:
        self.model, self.cache, self.sampler, self.device = model, cache, sampler, device
        self.swap_space = swap_space
        # Decode-only steps are the many small ones, where per-op overhead rivals the weight
        # reads: compiled graphs serve them (one for batch 1, one dynamic in batch size and
        # context for the rest). Rounding as eager does keeps bf16 outputs identical; Dynamo's
        # guards already check every input's shape, so the graph skips re-checking each
        # intermediate's; a C++ wrapper calls the kernels (about 7% of an int8 batch-1 step
        # saved against inductor's Python wrapper). The graphs belong to this engine's model
        # alone (see _private_forward), so Dynamo need not guard its modules and parameters:
        # about a thousand checks, half a millisecond per step.
        self.decode_forward = None
        if compile_decode:
            self.decode_forward = torch.compile(
                _private_forward(model), fullgraph=True,
                options={"emulate_precision_casts": True, "size_asserts": False, "cpp_wrapper": True,
                         "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.block_size = cache.block_size
        self.eos_token_ids = eos_token_ids

    def sample_row(self, seq: Sequence, num_samples: int) -> SampleRow:
        p = seq.params
        banned: list[int] = []
        if len(seq.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))
        proposals = 2 * seq.beam_width if seq.is_beam else 0
        generators = seq.sibling_generators[:num_samples] if num_samples > 1 else [seq.generator]
        return SampleRow(p, generators, seq.prompt_token_ids, seq.output_token_ids, banned, proposals)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, num_samples: dict[int, int] | None = None) -> list[SeqStepOutput]:
        """Runs one step. `num_samples` maps id(seq) to how many tokens to draw for it (n > 1
        at the end of a prompt); the default is one."""
        # Order matters: blocks freed by a swap-out may be refilled by a swap-in or a copy.
        if batch.swap_out:
            self.swap_space.swap_out(batch.swap_out)
        if batch.swap_in:
            self.swap_space.swap_in(batch.swap_in)
        self.cache.copy_blocks(batch.copies)
        input_ids, positions, slots = [], [], []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []           # batch index of each sampled row
        logit_rows: list[tuple[int, int]] = []  # (batch index, first row) of prompt-logprob chunks
        prefills: list[PrefillSegment] = []
        bs = self.block_size
        row = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            input_ids.extend(seq.token_at(p) for p in range(start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if i >= batch.num_decodes:
                block_ids = torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=self.device)
                prefills.append(PrefillSegment(start=row, num_tokens=n, context_len=end, block_ids=block_ids))
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                logit_rows.append((i, row))
            row += n
            if end == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_seqs.append(i)

        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                                 num_decode_tokens=batch.num_decodes, prefills=prefills)
        if batch.num_decodes:
            decodes = batch.seqs[: batch.num_decodes]
            width = max(len(s.block_table) for s in decodes)
            meta.decode_block_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in decodes],
                                                    dtype=torch.int32, device=self.device)
            meta.decode_context_lens = torch.tensor([s.num_computed_tokens + 1 for s in decodes],
                                                    dtype=torch.int32, device=self.device)

        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        if self.decode_forward is not None and not prefills:
            # The table width is any size, 1 included: no specialization on its value.
            torch._dynamo.decorators.mark_unbacked(meta.decode_block_tables, 1)
            hidden = self.decode_forward(ids, pos, self.cache, meta)
        else:
            hidden = self.model(ids, pos, self.cache, meta)
        outputs = [SeqStepOutput() for _ in batch.seqs]
        if sample_rows:
            sampled = hidden  # decode-only steps sample every row: no gather
            if len(sample_rows) < hidden.shape[0]:
                sampled = hidden[torch.tensor(sample_rows, device=self.device)]
            logits = self.model.compute_logits(sampled)
            rows = [self.sample_row(batch.seqs[i], (num_samples or {}).get(id(batch.seqs[i]), 1))
                    for i in sample_seqs]
            for i, result in zip(sample_seqs, self.sampler(logits, rows)):
                outputs[i].sample = result
        for i, first_row in logit_rows:
            outputs[i].prompt_logprobs = self._prompt_logprobs(batch.seqs[i], batch.num_new_tokens[i], hidden,
                                                               first_row)
        return outputs

    def _prompt_logprobs(self, seq: Sequence, n: int, hidden: torch.Tensor,
                         first_row: int) -> list[tuple[int, dict[int, Logprob]]]:
        """Row p predicts prompt token p + 1: score each prompt token this chunk can see."""
        start = seq.num_computed_tokens
        last = min(start + n, seq.num_prompt_tokens - 1)  # rows whose next token is in the prompt
        logprobs = self.model.compute_logits(hidden[first_row:first_row + last - start]).log_softmax(dim=-1)
        return [(p + 1, top_logprobs(logprobs[p - start], seq.prompt_token_ids[p + 1], seq.params.prompt_logprobs))
                for p in range(start, last)]

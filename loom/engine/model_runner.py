"""Model runner: turns a scheduled batch into tensors, runs the model, samples.

For each scheduled sequence it packs the tokens it computes this step (ids, positions, the
slot of each token in the paged pool) and describes its attention: decode rows by padded block
tables and context lengths, prefill chunks as segments. Rows whose sequence reaches its last
token this step are sampled.
"""
from __future__ import annotations

import torch

from loom.engine.scheduler import ScheduledBatch
from loom.engine.sequence import Sequence
from loom.kv.attention import AttentionMetadata, PrefillSegment
from loom.kv.cache import KVCache
from loom.layers.sampler import Sampler
from loom.models.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, sampler: Sampler, device: torch.device) -> None:
        self.model, self.cache, self.sampler, self.device = model, cache, sampler, device
        self.block_size = cache.block_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Runs one step; returns the sampled token of each sequence (None if it is mid-prompt)."""
        self.cache.copy_blocks(batch.copies)
        input_ids, positions, slots = [], [], []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
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
            row += n
            if end == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_seqs.append(seq)

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
        hidden = self.model(ids, pos, self.cache, meta)
        results: list[int | None] = [None] * len(batch.seqs)
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            tokens = self.sampler(logits, [s.params for s in sample_seqs], [s.generator for s in sample_seqs])
            index = {id(s): i for i, s in enumerate(batch.seqs)}
            for seq, tok in zip(sample_seqs, tokens):
                results[index[id(seq)]] = tok
        return results

"""Weight-only quantization: int8 per output channel, int4 group-wise; a state-dict transform
(quantize.py) plus a module swap (linear.py), with the kernel chosen by tokens per step
(dispatch.py) and quantized checkpoints (checkpoint.py)."""

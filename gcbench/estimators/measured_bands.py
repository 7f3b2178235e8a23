"""Written by benchmarks/error_bands.py (do not edit by hand): the errors of `estimate` against the GPU
measurements kept in the repository, per class (gcbench/estimators/bands.py): configs, median |error| %,
lowest and highest signed error %. From benchmarks/published, results/gpu/nvidia-h200."""

BANDS = {
    ('falcon', 'bf16', 'lora', 'none', 'eager', 'litgpt', 'lm', 'simulate'): (2, 1.49, -2.11, -0.86),
    ('gpt2', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'analytic'): (7, 1.5, -4.97, -1.0),
    ('gpt2', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'simulate'): (7, 1.5, -4.97, -1.01),
    ('gpt_neox', 'amp-bf16', 'lora', 'none', 'sdpa', 'litgpt', 'lm', 'simulate'): (2, 2.09, -3.22, -0.95),
    ('gpt_neox', 'bf16', 'lora', 'none', 'sdpa', 'litgpt', 'lm', 'simulate'): (3, 2.16, -3.25, -1.2),
    ('llama', 'bf16', 'lora', 'none', 'sdpa', 'ce', 'lm', 'simulate'): (2, 1.04, -1.34, -0.75),
    ('llama', 'bf16', 'lora', 'none', 'sdpa', 'chunked', 'lm', 'simulate'): (2, 1.07, -1.34, -0.79),
    ('llama', 'bf16', 'lora', 'none', 'sdpa', 'litgpt', 'lm', 'simulate'): (3, 0.91, -1.37, -0.9),
    ('llama', 'bf16', 'none', 'fsdp2:1', 'sdpa', 'ce', 'lm', 'analytic'): (3, 0.56, -0.36, 0.58),
    ('llama', 'bf16', 'none', 'fsdp2:1', 'sdpa', 'ce', 'lm', 'simulate'): (3, 0.36, -0.36, -0.34),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'analytic'): (38, 0.23, -0.86, -0.05),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'simulate'): (41, 0.25, -0.86, -0.05),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'chunked', 'lm', 'analytic'): (2, 0.37, -0.38, -0.36),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'chunked', 'lm', 'simulate'): (2, 0.33, -0.36, -0.3),
    ('llama', 'bf16', 'qlora', 'none', 'sdpa', 'ce', 'lm', 'simulate'): (2, 1.97, -2.82, -1.12),
    ('llama', 'bf16', 'qlora', 'none', 'sdpa', 'chunked', 'lm', 'simulate'): (1, 1.19, -1.19, -1.19),
    ('phi', 'bf16', 'lora', 'none', 'sdpa', 'litgpt', 'lm', 'simulate'): (3, 1.45, -2.03, -1.2),
}

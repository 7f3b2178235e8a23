"""Written by benchmarks/error_bands.py (do not edit by hand): the errors of `estimate` against the GPU
measurements kept in the repository, per class (gcbench/estimators/bands.py): configs, median |error| %,
lowest and highest signed error %. From benchmarks/published, results/gpu/nvidia-h200.
BANDS: the peak (max_memory_allocated); TIME_BANDS: the step time, on the card the records ran on;
ORDER_ERRORS: per card, the predicted ratio of two records' step times of one window against the
measured one, for pairs within a class and across two (pairs, median and 90th percentile, %).
"""

BANDS = {
    ('falcon', 'bf16', 'lora', 'none', 'eager', 'litgpt', 'lm', 'adamw', 'simulate'): (2, 1.49, -2.11, -0.86),
    ('gpt2', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw', 'analytic'): (7, 1.5, -4.97, -1.0),
    ('gpt2', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw', 'simulate'): (7, 1.5, -4.97, -1.01),
    ('gpt_neox', 'amp-bf16', 'lora', 'none', 'sdpa', 'litgpt', 'lm', 'adamw', 'simulate'): (2, 2.09, -3.22, -0.95),
    ('gpt_neox', 'bf16', 'lora', 'none', 'sdpa', 'litgpt', 'lm', 'adamw', 'simulate'): (3, 2.16, -3.25, -1.2),
    ('llama', 'bf16', 'lora', 'none', 'sdpa', 'ce', 'lm', 'adamw', 'simulate'): (2, 1.04, -1.34, -0.75),
    ('llama', 'bf16', 'lora', 'none', 'sdpa', 'chunked', 'lm', 'adamw', 'simulate'): (2, 1.07, -1.34, -0.79),
    ('llama', 'bf16', 'lora', 'none', 'sdpa', 'litgpt', 'lm', 'adamw', 'simulate'): (3, 0.91, -1.37, -0.9),
    ('llama', 'bf16', 'none', 'fsdp2:1', 'sdpa', 'ce', 'lm', 'adamw', 'analytic'): (3, 0.56, -0.36, 0.58),
    ('llama', 'bf16', 'none', 'fsdp2:1', 'sdpa', 'ce', 'lm', 'adamw', 'simulate'): (3, 0.36, -0.36, -0.34),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adafactor', 'analytic'): (4, 0.46, -0.86, -0.29),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adafactor', 'simulate'): (4, 0.46, -0.86, -0.29),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw', 'analytic'): (26, 0.1, -0.44, -0.05),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw', 'simulate'): (29, 0.1, -0.44, -0.05),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw-fused', 'analytic'): (4, 0.3, -0.44, -0.22),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw-fused', 'simulate'): (4, 0.3, -0.44, -0.22),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw8bit', 'analytic'): (4, 0.45, -0.65, -0.25),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw8bit', 'simulate'): (4, 0.45, -0.65, -0.25),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'chunked', 'lm', 'adamw', 'analytic'): (2, 0.37, -0.38, -0.36),
    ('llama', 'bf16', 'none', 'none', 'sdpa', 'chunked', 'lm', 'adamw', 'simulate'): (2, 0.33, -0.36, -0.3),
    ('llama', 'bf16', 'qlora', 'none', 'sdpa', 'ce', 'lm', 'adamw', 'simulate'): (2, 1.97, -2.82, -1.12),
    ('llama', 'bf16', 'qlora', 'none', 'sdpa', 'chunked', 'lm', 'adamw', 'simulate'): (1, 1.19, -1.19, -1.19),
    ('phi', 'bf16', 'lora', 'none', 'sdpa', 'litgpt', 'lm', 'adamw', 'simulate'): (3, 1.45, -2.03, -1.2),
}

TIME_BANDS = {
    ('h200-141gb', 'host-bound', 'gpt2', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw'):
        (1, 64.27, -64.27, -64.27),
    ('h200-141gb', 'kernel-bound', 'gpt2', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw'):
        (8, 39.13, -42.41, -36.6),
    ('h200-141gb', 'kernel-bound', 'llama', 'bf16', 'lora', 'none', 'sdpa', 'ce', 'lm', 'adamw'):
        (2, 18.2, -26.25, -10.15),
    ('h200-141gb', 'kernel-bound', 'llama', 'bf16', 'lora', 'none', 'sdpa', 'chunked', 'lm', 'adamw'):
        (2, 23.48, -24.34, -22.63),
    ('h200-141gb', 'kernel-bound', 'llama', 'bf16', 'none', 'fsdp2:1', 'sdpa', 'ce', 'lm', 'adamw'):
        (3, 13.75, -16.72, -13.02),
    ('h200-141gb', 'kernel-bound', 'llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adafactor'):
        (4, 16.17, -19.92, -15.42),
    ('h200-141gb', 'kernel-bound', 'llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw'):
        (29, 13.24, -38.45, -11.53),
    ('h200-141gb', 'kernel-bound', 'llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw-fused'):
        (4, 12.63, -12.79, -12.16),
    ('h200-141gb', 'kernel-bound', 'llama', 'bf16', 'none', 'none', 'sdpa', 'ce', 'lm', 'adamw8bit'):
        (4, 27.85, -28.74, -25.41),
    ('h200-141gb', 'kernel-bound', 'llama', 'bf16', 'none', 'none', 'sdpa', 'chunked', 'lm', 'adamw'):
        (2, 16.65, -22.14, -11.17),
    ('h200-141gb', 'kernel-bound', 'llama', 'bf16', 'qlora', 'none', 'sdpa', 'ce', 'lm', 'adamw'):
        (2, 36.41, -46.44, -26.37),
    ('h200-141gb', 'kernel-bound', 'llama', 'bf16', 'qlora', 'none', 'sdpa', 'chunked', 'lm', 'adamw'):
        (1, 34.36, -34.36, -34.36),
}

ORDER_ERRORS = {
    'h200-141gb': {'within': (113, 1.9, 13.6), 'across': (77, 4.6, 17.0)},
}

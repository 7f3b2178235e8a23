"""Written by benchmarks/error_bands.py (do not edit by hand): the errors of `estimate` against the GPU
measurements kept in the repository, per class (gcbench/estimators/bands.py): configs, median |error| %,
lowest and highest signed error %. From benchmarks/published, results/gpu/nvidia-h200."""

BANDS = {
    ('falcon', 'bf16', 'lora', 'none', 'simulate'): (2, 10.34, -19.37, -1.31),
    ('gpt2', 'bf16', 'none', 'none', 'analytic'): (7, 1.5, -4.97, -1.0),
    ('gpt2', 'bf16', 'none', 'none', 'simulate'): (7, 1.5, -4.97, -1.01),
    ('gpt_neox', 'amp-bf16', 'lora', 'none', 'simulate'): (2, 11.85, -12.71, -11.0),
    ('gpt_neox', 'bf16', 'lora', 'none', 'simulate'): (3, 0.45, 0.43, 0.48),
    ('llama', 'bf16', 'lora', 'none', 'simulate'): (7, 0.75, -1.34, -0.27),
    ('llama', 'bf16', 'none', 'fsdp2:1', 'analytic'): (3, 0.56, -0.36, 0.58),
    ('llama', 'bf16', 'none', 'fsdp2:1', 'simulate'): (3, 0.36, -0.36, -0.34),
    ('llama', 'bf16', 'none', 'none', 'analytic'): (40, 0.25, -0.86, -0.05),
    ('llama', 'bf16', 'none', 'none', 'simulate'): (43, 0.25, -0.86, -0.05),
    ('llama', 'bf16', 'qlora', 'none', 'simulate'): (3, 1.19, -2.82, -1.12),
    ('phi', 'bf16', 'lora', 'none', 'simulate'): (3, 3.34, 2.15, 4.02),
}

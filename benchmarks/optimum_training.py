"""optimum-benchmark's training scenario on the tiny llama that `gcbench run --model tiny-llama` builds: the peer
benchmarks/startup.py times gcbench against, as whole processes. Needs optimum-benchmark, in an environment of its
own (it pins its own dependencies): `python -m venv ob && ob/bin/pip install torch transformers optimum-benchmark`,
then `ob/bin/python benchmarks/optimum_training.py`.

The model: tiny-llama with random weights, saved to --out by `--prepare` (once, untimed: its `no_weights` option
fetches config.json from the Hub, which a machine without network cannot); the same sequence (32), batch (1), one
warm-up and three timed steps, CPU, in a child process (its process launcher, the one it recommends for
benchmarking; --launcher inline: in this process), latency tracked, memory not (gcbench's CPU run tracks it: a
gcbench run measures more). Tried with optimum-benchmark 0.6.0, which needs transformers < 5 (4.57.6 here).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for gcbench.presets, a dict of config values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="a folder for the config and the trainer's output")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--prepare", action="store_true", help="save the model to --out and exit")
    ap.add_argument("--launcher", choices=("process", "inline"), default="process",
                    help="process: the benchmark in a child process, what optimum-benchmark recommends for "
                         "benchmarking (its inline launcher is 'for debugging purposes')")
    args = ap.parse_args()
    model = args.out / "tiny-llama"
    if args.prepare:
        return prepare(model)

    from optimum_benchmark import (Benchmark, BenchmarkConfig, InlineConfig, ProcessConfig, PyTorchConfig,
                                   TrainingConfig)

    config = BenchmarkConfig(
        name="tiny-llama-training",
        launcher=ProcessConfig() if args.launcher == "process" else InlineConfig(),
        backend=PyTorchConfig(model=str(model), device="cpu", no_weights=False, task="text-generation",
                              library="transformers", model_type="llama"),
        scenario=TrainingConfig(max_steps=4, warmup_steps=1, latency=True, memory=False,
                                dataset_shapes={"dataset_size": 8, "sequence_length": args.seq},
                                training_arguments={"per_device_train_batch_size": 1, "use_cpu": True,
                                                    "output_dir": str(args.out / "trainer")}),
    )
    report = Benchmark.launch(config)
    print(report.to_dict().get("overall", {}).get("latency", {}).get("mean"))


def prepare(model: Path) -> None:
    import transformers

    from gcbench.presets import MODELS

    fields = dict(MODELS["tiny-llama"].config)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model)


if __name__ == "__main__":
    main()

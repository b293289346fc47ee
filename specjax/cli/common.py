"""Pieces shared by the command-line tools: one-line errors (in flags), prompt files, model and sampling flags."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp

from specjax.config import ATTENTION_CHOICES, INT32_END, SamplingConfig
from specjax.errors import InputError, OutputError, SpecjaxError
from specjax.host import start_distributed, write_file
from specjax.io.jsonl import read_prompt_records
from specjax.io.loading import load_model
from specjax.io.tokenizer import Tokenizer
from specjax.models.quantize import QUANTIZE_CHOICES
from specjax.sharding import parse_mesh

RawDescription = argparse.RawDescriptionHelpFormatter
DEFAULT_DRAFT_TOKENS = 5  # K, drafts per round, of specjax-generate and specjax-bench when none is given


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line on stderr and exit code 2."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


# XLA's oneDNN fusion of dots: faster decoding on x86 CPUs at every batch and token count measured, though not a
# faster training step (docs/cpu.md). XLA reads XLA_FLAGS at JAX's first computation, so an entry point sets it.
ONEDNN_DOTS = "--xla_cpu_experimental_onednn_fusion_type"


def prefer_onednn_dots() -> None:
    """Adds the oneDNN dot fusion to XLA_FLAGS on an x86 machine, unless XLA_FLAGS already sets that option."""
    flags = os.environ.get("XLA_FLAGS", "")
    if platform.machine() in ("x86_64", "AMD64") and ONEDNN_DOTS not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {ONEDNN_DOTS}=dot".strip()


def flag_spelling(name: str, value: object) -> str:
    """A setting a library error names (`specjax.errors.SpecjaxError.spelled`), as the flag that sets it: the
    setting's name with dashes (`num_draft_tokens` -> `--num-draft-tokens`), then its value as the flag takes it
    (`--mesh data=1,tensor=2`, `--quantize int8`)."""
    flag = "--" + name.replace("_", "-")
    if value is None:
        return flag
    if isinstance(value, Mapping):
        value = ",".join(f"{axis}={size}" for axis, size in value.items())
    return f"{flag} {value}"


def run(main: Callable[[Sequence[str] | None], None], prog: str, argv: Sequence[str] | None = None) -> None:
    """Runs a CLI body: a SpecjaxError becomes one line on stderr and exit code 2, never a traceback."""
    try:
        main(argv)
    except SpecjaxError as e:
        print(f"{prog}: error: {e.spelled(flag_spelling)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)


def add_model_args(parser: argparse.ArgumentParser, batch_default: str = "all, at most 8") -> None:
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="built-in name (smollm2-135m), a .gguf file, an HF model folder, or a Hugging Face Hub repo "
        "ORG/NAME[@REVISION]",
    )
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument(
        "--prompts-file",
        type=Path,
        help='JSONL file, one {"prompt": ...} object per line, optionally with its own "max_new_tokens"',
    )
    parser.add_argument("--raw", action="store_true", help="tokenize prompts as they are, without the chat template")
    parser.add_argument("--max-new-tokens", type=integer, default=128)
    parser.add_argument(
        "--prefill-chunk",
        type=integer,
        default=None,
        metavar="N",
        help="prompt tokens per prefill forward (default: 64 on the CPU, 512 on GPU and TPU)",
    )
    parser.add_argument(
        "--batch-size", type=integer, default=None, help=f"prompts per batch (default: {batch_default})"
    )
    parser.add_argument(
        "--mesh",
        default="auto",
        metavar="data=D,tensor=T",
        help="the devices the model is split over: 'auto' (the default) uses every local device, tensor-parallel as "
        "far as the KV heads divide and the rest data-parallel; an axis left out has size 1, -1 means the rest",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="weight and KV cache dtype; auto: bfloat16 on GPU and TPU, float32 on the CPU",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default="none",
        help="int8: the target's matrices as int8 with a scale per output channel, dequantized in the matmul "
        "(weight-only; drafts stay in --dtype)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default="auto",
        help="how decode steps read the KV cache: blocks, the pure-JAX block loop; pallas, the Pallas kernel (TPU; "
        "interpreted elsewhere); auto (the default): on TPU the kernel once it has compiled and matched the loop on a "
        "small input, else the loop",
    )
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT|auto",
        help="multi-host: run the same command on every host with the coordinator's address (process 0's), or "
        "'auto' where jax.distributed finds it (TPU pods, SLURM, MPI, Kubernetes); process 0 prints and writes",
    )
    parser.add_argument("--num-processes", type=integer, help="multi-host: the number of processes")
    parser.add_argument("--process-id", type=integer, help="multi-host: this process's index, 0 first")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=integer, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0, help="0..2**63-1")


def sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def load_target(args: argparse.Namespace):
    """The --model, in --dtype (int8 matrices with --quantize int8), read straight into its shards on --mesh (across
    the processes of a multi-host run, which this joins first), its cache read as --attention says."""
    if args.coordinator is not None:
        start_distributed(None if args.coordinator == "auto" else args.coordinator, args.num_processes, args.process_id)
    dtype = None if args.dtype == "auto" else jnp.dtype(args.dtype)
    mesh = "auto" if args.mesh == "auto" else parse_mesh(args.mesh)
    return load_model(args.model, dtype, mesh, args.quantize, attention=args.attention)


def gather_requests(args: argparse.Namespace, default: Sequence[str] = ()) -> list[tuple[str, int]]:
    """Each prompt with its max_new_tokens: the prompts file's own where a line gives one, else --max-new-tokens."""
    requests = [(p, args.max_new_tokens) for p in args.prompt]
    if args.prompts_file is not None:
        records = read_prompt_records(args.prompts_file)
        requests += [(r.prompt, r.max_new_tokens or args.max_new_tokens) for r in records]
    return requests or [(p, args.max_new_tokens) for p in default]


def gather_prompts(args: argparse.Namespace, default: Sequence[str] = ()) -> list[str]:
    return [p for p, _ in gather_requests(args, default)]


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str], raw: bool) -> list[list[int]]:
    """Token ids of each prompt: through the model's chat template, or as raw text."""
    if raw:
        return [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    return [tokenizer.chat_prompt_ids(p) for p in prompts]


def batches(items: Sequence, size: int) -> list[Sequence]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def check_output_file(path: str | Path) -> Path:
    """An output file that can be written: not a folder, in a folder that exists (or can be made) and is writable.
    Checked before any work, so a bad path never loses results."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a folder; give a file name for the output")
    check_output_dir(path.parent)
    return path


def check_output_dir(folder: Path) -> Path:
    """Makes `folder` if needed and checks that files can be written in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create the output folder {str(folder)!r}: {e.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise InputError(f"cannot write in the output folder {str(folder)!r}: permission denied")
    return folder


def write_results(path: Path, text: str) -> None:
    """Writes a results file (atomically, never through a link). When the disk refuses, the results go to stdout
    instead, so nothing is lost, and the one-line error (exit code 2) says so."""
    try:
        write_file(path, text)
    except OutputError as e:
        sys.stdout.write(text)
        raise OutputError(f"{e}; the results are on stdout instead") from None


def integer(text: str) -> int:
    """An argparse type: an integer that fits the int32 arrays it ends up in."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -INT32_END <= value < INT32_END:
        raise argparse.ArgumentTypeError(f"{value} is too large: the arrays hold 32-bit integers (below 2**31)")
    return value


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def check_positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise InputError(f"{name} must be >= 1, got {value}")


def draft_tokens(value: str) -> int | str:
    """--num-draft-tokens: a positive integer or 'auto'."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None

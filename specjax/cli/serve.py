"""specjax-serve: an OpenAI-compatible HTTP server (completions, chat completions, streaming) over the refilling
engine, with any drafter."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import jax
import uvicorn

from specjax.cli import common as cli
from specjax.config import SamplingConfig
from specjax.drafters import spec_help, tree_specs
from specjax.errors import InputError
from specjax.host import status
from specjax.models.attention import attention_path
from specjax.prepare import DecodeConfig, serving_engine
from specjax.serving import build_app
from specjax.serving.hosts import first_line, follow


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="specjax-serve", description=__doc__)
    cli.add_model_args(p, batch_default="8")
    p.add_argument("--drafter", default="none", help=f"speculative drafter: {spec_help()}")
    p.add_argument(
        "--num-draft-tokens",
        type=cli.draft_tokens,
        default="auto",
        help="K, draft tokens per round (with --drafter); 'auto': adaptive drafting from this machine's costs",
    )
    p.add_argument("--tree", default=None, metavar="DEPTH,TOPK,BUDGET", help=f"with --drafter {tree_specs()}: a tree")
    p.add_argument(
        "--max-context",
        type=cli.integer,
        default=None,
        help="the longest prompt + max_tokens a request may ask for (default: the model's length, at most 4096)",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients name (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=cli.integer, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPECJAX_API_KEY"),
        help="the /v1 routes want 'Authorization: Bearer KEY' (default: $SPECJAX_API_KEY; unset: open)",
    )
    # A request without max_tokens gets what the context leaves (as vLLM), unless --max-new-tokens is given.
    p.set_defaults(max_new_tokens=None)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    cli.check_positive("--batch-size", args.batch_size)
    cli.check_positive("--prefill-chunk", args.prefill_chunk)
    cli.check_positive("--max-new-tokens", args.max_new_tokens)
    if args.prompt or args.prompts_file:
        raise InputError("specjax-serve takes its prompts over HTTP: leave out --prompt and --prompts-file")
    model = cli.load_target(args)
    context = args.max_context or min(model.cfg.max_position_embeddings, 4096)
    if not 1 <= context <= model.cfg.max_position_embeddings:
        raise InputError(f"--max-context must be in 1..{model.cfg.max_position_embeddings}, got {context}")
    slots = args.batch_size or 8
    config = DecodeConfig(
        drafter=args.drafter,
        num_draft_tokens=args.num_draft_tokens,
        tree=args.tree,
        sampling=SamplingConfig(temperature=1.0),  # calibrated for sampled requests
        rows=slots,
        prefill_chunk=args.prefill_chunk,
    )
    engine = serving_engine(model, config, context)
    if jax.process_index() > 0:
        status(f"process {jax.process_index()} follows process 0's engine steps")
        try:
            follow(engine)
        except jax.errors.JaxRuntimeError as e:
            failed(f"process 0 or another process is gone, so this one stops: {first_line(e)}")
        return
    name = args.served_model_name or args.model
    status(
        f"serving {name} on http://{args.host}:{args.port}/v1 ({slots} slots of {engine.num_slots} tokens, "
        f"attention {attention_path(args.attention)}; {engine.compiled_programs} programs compiled)"
    )

    def stop() -> None:
        server.should_exit = True

    app = build_app(
        engine, model.tokenizer, name, default_max_tokens=args.max_new_tokens, api_key=args.api_key, on_failure=stop
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)
    )
    server.run()
    if app.state.server.worker.failure is not None:
        failed(app.state.server.worker.failure)


def failed(message: str) -> None:
    """Ends a multi-host process whose peer is gone: one line, exit code 1, at once (jax.distributed's shutdown at
    exit would wait for the dead peer)."""
    print(f"specjax-serve: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def entry(argv: Sequence[str] | None = None) -> None:
    cli.prefer_onednn_dots()
    cli.run(main, "specjax-serve", argv)


if __name__ == "__main__":
    entry()

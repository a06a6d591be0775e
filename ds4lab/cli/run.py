"""``ds4lab run``: one prompt (``-p`` or ``--prompt-file``) generated once, or, without one, the interactive chat
(:mod:`ds4lab.cli.chat`). The flags' checks and warnings, the context and thinking mode, the prompt's tokens."""

from __future__ import annotations

import sys

from .chat import repl
from .common import (
    DEFAULT_CTX,
    RENDER,
    THINK_MAX_MIN_CTX,
    UsageError,
    describe,
    effective_think,
    err,
    load_model,
    read_text,
)
from .generate import no_room, run_prompt


def _one_shot_ids(model, args, text: str, ctx: int) -> list[int]:
    tk = model.tokenizer
    if args.raw:
        return tk.encode(text)
    if text.startswith("<｜begin▁of▁sentence｜>"):  # an already rendered chat prompt, as ds4 accepts it
        return tk.encode_rendered(text)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": text})
    return tk.render_chat(messages, think=RENDER[effective_think(args.think, ctx)])


_THINK_FLAGS = {"none": "--nothink", "high": "--think", "max": "--think-max"}


def run_command(args) -> int:
    if args.raw and args.prompt is None and args.prompt_file is None:
        raise UsageError("--raw needs -p or --prompt-file")
    if args.ctx is not None and args.ctx < 2:
        raise UsageError("--ctx must be at least 2")
    think_flag = args.think  # None: no thinking flag given
    args.think = args.think or "high"
    text = args.prompt if args.prompt is not None else None
    if args.prompt_file is not None:
        text = read_text(args.prompt_file)
    if sys.stdout.encoding and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    model = load_model(args)
    raw_by_default = args.raw is None
    if args.raw is None:
        args.raw = text is not None and not model.is_chat
    ctx = args.ctx or min(DEFAULT_CTX, model.config.context_length)
    if args.raw:
        think = "none (plain text)"
        if think_flag in ("high", "max"):
            why = "the model has no chat template" if raw_by_default else "--raw"
            err(f"warning: {_THINK_FLAGS[think_flag]} has no effect: the prompt is continued as plain text ({why}); "
                "add --chat to render it as a chat turn with thinking")
    else:
        if args.think == "max" and ctx < THINK_MAX_MIN_CTX:
            err(f"warning: --think-max needs --ctx >= {THINK_MAX_MIN_CTX}; ctx={ctx} uses normal thinking")
        think = effective_think(args.think, ctx)

    if text is None:
        return repl(model, args, ctx)

    ids = _one_shot_ids(model, args, text, ctx)
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= ctx - 1:
        raise ValueError(no_room(len(ids), ctx))
    sess = model.session(ctx=ctx, prefill_chunk=args.prefill_chunk)
    err(f"{describe(model)}, ctx {ctx}, prefill chunk {sess.prefill_chunk}, think {think}")
    turn = run_prompt(sess, ids, args, thinking=not args.raw and think != "none")
    err(turn.line())
    return 0

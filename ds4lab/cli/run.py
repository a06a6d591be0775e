"""``ds4lab run``: one prompt (``-p`` or ``--prompt-file``) generated once, or, without one, the interactive chat
(:mod:`ds4lab.cli.chat`). The flags' checks and warnings, the context and thinking mode, the prompt's tokens."""

from __future__ import annotations

import sys

from ..tokenizer import effective_think
from .chat import repl
from .common import (
    DEFAULT_SYSTEM,
    MIN_CTX,
    THINK_FLAGS,
    UsageError,
    check_input,
    context_size,
    describe,
    err,
    load_model,
    read_text,
    thinking_mode,
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
    return tk.render_chat(messages, think=effective_think(args.think, ctx))


def _settle_raw(args, model, text) -> bool:
    """Decides --raw where no flag did (plain text for a model without a chat template); True if so decided."""
    by_default = args.raw is None
    if by_default:
        args.raw = text is not None and not model.is_chat
    return by_default


def graph_command(args) -> int:
    """``--graph-test``, ``--graph-full-test``, ``--graph-prompt-test``: the model loaded twice, with and without
    ds4lab's kernels, run on the prompt and compared stage by stage (:mod:`ds4lab.graph_check`). Exit code 1 when
    a stage is beyond its tolerance."""
    from .. import graph_check

    flag = {"decode": "--graph-test", "full": "--graph-full-test", "prompt": "--graph-prompt-test"}[args.graph_test]
    if args.no_kernels:
        raise UsageError(f"{flag} compares the kernels with the plain ops: drop --no-kernels")
    if args.prompt is None and args.prompt_file is None:
        raise UsageError(f"{flag} needs a prompt (-p or --prompt-file)")
    check_input(args.prompt_file, "--prompt-file")
    text = args.prompt if args.prompt is not None else read_text(args.prompt_file)
    if args.prefill_matmul == "auto":  # the check is of the kernels: TF32 would add its own rounding to every chunk
        args.prefill_matmul = "float32"
    fast = load_model(args)
    if fast.backend.kernels is None:
        raise UsageError(f"{flag} checks ds4lab's GPU kernels against its plain ops, and the {fast.backend.name} "
                         f"backend runs none here (no GPU): run it where --backend mlx has Metal or mlx[cuda13], "
                         f"or --backend cupy a CUDA GPU")
    ctx = context_size(args.ctx, fast)
    args.no_kernels, args.prefill_matmul, args.decode_matmul = True, "float32", "float32"
    plain = load_model(args)
    args.think = args.think or ("high" if fast.is_chat else "none")  # as run_command's
    _settle_raw(args, fast, text)
    ids = _one_shot_ids(fast, args, text, ctx)
    if not ids:
        raise ValueError("the prompt is empty")
    if args.graph_test == "prompt":
        most = fast.config.context_length
        ctx = args.ctx or min(len(ids) + 2, most or len(ids) + 2)  # room for the prompt and one decode step
        if len(ids) + 1 >= ctx:
            raise ValueError(no_room(len(ids), ctx, most=most))
        err(f"{describe(fast)}: {flag} on {len(ids)} prompt tokens (the kernels' path against the plain ops')")
        report = graph_check.prompt_test(fast, plain, ids, ctx, args.prefill_chunk)
    else:  # as ds4's: the prompt's first token (BOS for a chat prompt) as a decode step at position 0
        err(f"{describe(fast)}: {flag} on the prompt's first token (the kernels' path against the plain ops')")
        test = graph_check.decode_test if args.graph_test == "decode" else graph_check.full_test
        report = test(fast, plain, ids[0])
    print(report)
    return 0 if report.passed else 1


def run_command(args) -> int:
    if args.graph_test:
        return graph_command(args)
    if args.raw and args.prompt is None and args.prompt_file is None:
        raise UsageError("--raw needs -p or --prompt-file")
    if args.ctx is not None and args.ctx < MIN_CTX:
        raise UsageError(f"--ctx must be at least {MIN_CTX}, got {args.ctx}")
    think_flag = args.think  # None: no thinking flag given
    text = args.prompt if args.prompt is not None else None
    if args.prompt_file is not None:
        check_input(args.prompt_file, "--prompt-file")
        text = read_text(args.prompt_file)
    if sys.stdout.encoding and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    model = load_model(args)
    # ds4's default, thinking, for a chat model; a model without a chat template (the embedded one) never learnt to
    # end its reasoning, so its chat turns think only when asked (as serve's requests)
    args.think = think_flag or ("high" if model.is_chat else "none")
    ctx = context_size(args.ctx, model)  # the model's context length caps it: more is refused, as serve does
    raw_by_default = _settle_raw(args, model, text)
    if args.raw:
        think = "none (plain text)"
        why = "the model has no chat template" if raw_by_default else "--raw"
        unused = [(THINK_FLAGS[think_flag], "thinking")] if think_flag in ("high", "max") else []
        unused += [("-sys", "the system prompt")] if args.system not in ("", DEFAULT_SYSTEM) else []
        for flag, what in unused:  # chat settings a plain-text continuation leaves out
            err(f"warning: {flag} has no effect: the prompt is continued as plain text ({why}); add --chat to render "
                f"it as a chat turn with {what}")
    else:
        think = thinking_mode(args.think, ctx)

    if text is None:
        return repl(model, args, ctx)

    ids = _one_shot_ids(model, args, text, ctx)
    if not ids:
        raise ValueError(f"--prompt-file {args.prompt_file}: the prompt is empty" if args.prompt_file is not None
                         else "the prompt is empty")
    if len(ids) >= ctx - 1:
        raise ValueError(no_room(len(ids), ctx, most=model.config.context_length))
    sess = model.session(ctx=ctx, prefill_chunk=args.prefill_chunk)
    err(f"{describe(model)}, ctx {ctx}, prefill chunk {sess.prefill_chunk}, think {think}")
    turn = run_prompt(sess, ids, args, thinking=not args.raw and think != "none")
    err(turn.line())
    return 0

"""The interactive chat of ``ds4lab run`` without a prompt: :class:`Chat` keeps the transcript as ds4's REPL does
and syncs it into one session per turn; :func:`repl` reads the lines and the slash commands."""

from __future__ import annotations

import sys
from pathlib import Path

from ..tokenizer import THINK_MAX_MIN_CTX, effective_think
from .common import MIN_CTX, decoded, describe, err, read_text
from .generate import Turn, generate, no_room, sync

REPL_HELP = """Commands:
  /help          Show this help.
  /think         Use normal thinking mode.
  /think-max     Use Think Max (only when the context is at least 393216 tokens).
  /nothink       Disable thinking mode.
  /ctx N         Start a new session of N tokens (the transcript is kept and prefilled again).
  /read FILE     Read a prompt from FILE and run it as the next user message.
  /stats         Show the session: tokens, KV bytes, and what the last turn reused.
  /quit, /exit   Leave the prompt (Ctrl+D too).
  Ctrl+C         Stop the current generation and return to the prompt."""
NO_ARGUMENT = ("/help", "/think", "/think-max", "/nothink", "/stats", "/quit", "/exit")  # a word after them is refused


class Chat:
    """The interactive transcript, as ds4's REPL keeps it: rendered turns plus the generated tokens and an
    EOS after each reply, synced into one session per turn so only the new part is evaluated."""

    def __init__(self, model, args, ctx: int):
        self.model = model
        self.tk = model.tokenizer
        self.args = args
        self.system = args.system
        self.think = args.think
        self.ctx = ctx
        self.sess = model.session(ctx=ctx, prefill_chunk=args.prefill_chunk)
        self.transcript = self._head()
        self.last: Turn | None = None
        self.turns = 0

    @property
    def mode(self) -> str:
        return effective_think(self.think, self.ctx)

    def _head(self) -> list[int]:
        """BOS, the Think Max prefix when active, the system prompt."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return self.tk.render_chat(system, think=self.mode, add_generation_prompt=False)

    def _rehead(self, change) -> None:
        old = self._head()
        change()
        self.transcript = self._head() + self.transcript[len(old):]

    def set_think(self, mode: str) -> None:
        self._rehead(lambda: setattr(self, "think", mode))

    def set_ctx(self, ctx: int) -> None:
        def change():
            self.sess = self.model.session(ctx=ctx, prefill_chunk=self.args.prefill_chunk)
            self.ctx = ctx

        self._rehead(change)

    def user_turn(self, text: str) -> Turn:
        mode = self.mode
        rendered = self.tk.render_chat([{"role": "user", "content": text}], think=mode)
        base = self.tk.render_chat([], think=mode, add_generation_prompt=False)
        rollback = len(self.transcript)
        ids = self.transcript + rendered[len(base):]
        if len(ids) >= self.ctx - 1:
            raise ValueError(no_room(len(ids), self.ctx, "this turn (the transcript and the new message)", "/ctx",
                                     most=self.model.config.context_length))
        if self.sess.tokens and self.sess.logits is not None:
            self.sess.checkpoint()  # free; lets a turn after an interrupted one restore instead of re-prefilling
        try:
            result, prefill_seconds = sync(self.sess, ids)
        except BaseException:
            self.transcript = self.transcript[:rollback]
            raise
        tokens, gen_seconds, stop = generate(self.sess, self.args, thinking=mode != "none")
        if stop == "interrupted" and not tokens:
            self.transcript = self.transcript[:rollback]  # as ds4: nothing of the turn is kept
        else:
            self.transcript = ids + tokens + [self.tk.eos_id]  # ds4 appends EOS to the transcript
        self.turns += 1
        self.last = Turn(len(ids), result.source, result.reused, result.evaluated, prefill_seconds, tokens,
                         gen_seconds, stop, self.sess.kv_bytes)
        return self.last

    def stats(self) -> str:
        s = self.sess
        line = (f"session: {len(s.tokens)}/{s.ctx} tokens (prefill chunk {s.prefill_chunk}), KV {s.kv_bytes} bytes; "
                f"transcript {len(self.transcript)} tokens; think {self.mode}")
        if self.last is not None:
            t = self.last
            line += (f"; turn {self.turns}: reused {t.reused} ({t.source}), evaluated {t.evaluated}, "
                     f"generated {len(t.tokens)} ({t.stop})")
        note = self._difference()
        return line + (f"\n  ({note})" if note else "")

    def _difference(self) -> str:
        """Why the session's token count and the transcript's differ, in words."""
        held, kept = list(self.sess.tokens), self.transcript
        if held == kept:
            return ""
        if kept[:len(held)] == held:
            extra = len(kept) - len(held)
            if not held and not self.turns:
                return (f"the transcript's {extra} tokens (the start of the chat: BOS and the system prompt) are "
                        "not in the KV cache yet: the first turn evaluates them with its message")
            if not held:
                return (f"the transcript's {extra} tokens are not in this session's KV cache yet (a new session "
                        "started): the next turn evaluates them with its message")
            if extra == 1 and kept[-1] == self.tk.eos_id:
                return ("the transcript is 1 token longer: it ends with the end-of-sequence token that ds4 "
                        "appends after each reply, and the KV cache holds only what the model has read so far; "
                        "the next turn reads that token first")
            return (f"the transcript's last {extra} tokens are not in the KV cache yet: the next turn evaluates "
                    "them with its message")
        common = next((i for i, (a, b) in enumerate(zip(held, kept)) if a != b), min(len(held), len(kept)))
        return (f"the KV cache holds {len(held) - common} tokens that are not in the transcript (an interrupted "
                f"turn, which the transcript drops as ds4 does); they share the first {common} tokens, and the "
                "next turn brings the KV cache back to the transcript, from a checkpoint where it can")


def repl(model, args, ctx: int) -> int:
    chat = Chat(model, args, ctx)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    err(f"{describe(model)}, ctx {ctx}, prefill chunk {chat.sess.prefill_chunk}, think {chat.mode}")
    print(REPL_HELP, flush=True)
    while True:
        try:
            line = input("ds4lab> ")
        except EOFError:
            if interactive:
                print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        cmd = line.strip()  # as typed: /read's path keeps its bytes; text for the model is decoded()
        if not cmd:
            continue
        word, _, rest = cmd.partition(" ")
        rest = rest.strip()
        try:
            if word in NO_ARGUMENT and rest:
                err(f"{word} takes no argument, got {decoded(rest)!r}")
            elif cmd in ("/quit", "/exit"):
                return 0
            elif cmd == "/help":
                print(REPL_HELP)
            elif cmd == "/think":
                chat.set_think("high")
                print("Thinking mode: high.")
            elif cmd == "/think-max":
                chat.set_think("max")
                if chat.mode == "max":
                    print("Thinking mode: max.")
                else:
                    print(f"Thinking mode: high (Think Max needs ctx >= {THINK_MAX_MIN_CTX}).")
            elif cmd == "/nothink":
                chat.set_think("none")
                print("Thinking mode: none.")
            elif cmd == "/stats":
                print(chat.stats())
            elif word == "/ctx":
                try:
                    n = int(rest)
                except ValueError:
                    n = 0
                most = chat.model.config.context_length
                if n < MIN_CTX:
                    err(f"/ctx needs an integer of at least {MIN_CTX}, got {rest!r}")
                elif most and n > most:
                    err(f"/ctx must be in [{MIN_CTX}, {most}] for this model, got {n}")
                else:
                    chat.set_ctx(n)
                    print(f"New session: ctx {n}, prefill chunk {chat.sess.prefill_chunk}.")
            elif word == "/read":
                if not rest:
                    err("/read needs a file path")
                else:
                    _turn(chat, read_text(Path(rest)))
            elif cmd.startswith("/"):
                err(f"unknown command: {decoded(word)} (type /help for commands)")
            else:
                _turn(chat, decoded(cmd))
        except KeyboardInterrupt:
            print()
            err("interrupted")
        except (ValueError, OSError, RuntimeError) as e:
            err(f"error: {e}")
        sys.stdout.flush()


def _turn(chat: Chat, text: str) -> None:
    turn = chat.user_turn(text)
    err(turn.line())

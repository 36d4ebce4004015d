"""`llmfast chat`: the session logic (prefix-cache reuse across turns, commands), piped
mode through the real command, and a pseudo-terminal run with Ctrl-C mid-reply."""

from __future__ import annotations

import os
import re
import sys
import termios
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmfast.cli.chat.session import ChatCommandError, ChatSession, ChatSettings
from llmfast.cli.main import app
from tests.helpers.chat_model import make_chat_model

REPO = Path(__file__).resolve().parents[1]
GREEDY = ["--temperature", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="module")
def llm(chat_model):
    from llmfast import LLM

    return LLM(str(chat_model), device="cpu", block_size=8)


def run_chat(model: Path, text: bytes, *args: str):
    return CliRunner().invoke(app, ["chat", "--model", str(model), *GREEDY, *args], input=text)


# ---------------------------------------------------------------------- session


def test_second_turn_reuses_cached_blocks(llm):
    session = ChatSession(llm, ChatSettings(temperature=0.0, max_tokens=8),
                          system="You are a test model.")
    first = session.reply("hello there", lambda d: None)
    second = session.reply("how are you today?", lambda d: None)
    assert first.num_cached_tokens == 0 or first.num_cached_tokens < first.num_prompt_tokens
    # Turn 2's prompt starts with turn 1's prompt: at least its full blocks are cached.
    assert second.num_cached_tokens >= (first.num_prompt_tokens // 8) * 8 > 0
    assert session.totals.turns == 2 and len(session.history) == 4
    session.handle_command("/reset")
    again = session.reply("hello there", lambda d: None)
    assert again.text == first.text  # greedy: same conversation, same answer
    assert again.num_cached_tokens > 0  # turn 1's blocks are still in the cache


def test_aborted_reply_is_dropped_and_freed(llm):
    session = ChatSession(llm, ChatSettings(temperature=0.0, max_tokens=200, ignore_eos=True))
    steps = []
    result = session.reply("hello there", lambda d: None,
                           should_stop=lambda: steps.append(1) or len(steps) >= 3)
    assert result.aborted and result.finish_reason == "abort"
    assert 0 < result.num_output_tokens < 200
    assert session.history == [] and session.totals.aborted == 1
    assert not llm.engine.has_unfinished()
    llm.engine.step()  # the runner drops the aborted row on the next step
    stats = llm.engine.stats()
    assert stats.kv_cache_usage == 0.0


def test_commands_change_settings(llm):
    session = ChatSession(llm, ChatSettings())
    session.handle_command("/temp 0.2")
    session.handle_command("/top_p 0.9")
    session.handle_command("/top_k 5")
    session.handle_command("/max_tokens 7")
    session.handle_command("/seed 11")
    session.handle_command("/ignore_eos on")
    assert session.settings == ChatSettings(0.2, 0.9, 5, 7, 11, True)
    session.handle_command("/seed none")
    assert session.settings.seed is None
    for bad in ("/temp -1", "/top_p 0", "/top_p 2", "/max_tokens 0", "/top_k x", "/temp",
                "/frob", "/ignore_eos maybe"):
        with pytest.raises(ChatCommandError):
            session.handle_command(bad)
    assert session.settings.temperature == 0.2  # a bad value never replaces a good one
    session.handle_command("/system Be brief.")
    assert session.system == "Be brief." and session.history == []


def test_long_history_drops_oldest_turns(chat_model):
    from llmfast import LLM

    llm = LLM(str(chat_model), device="cpu", max_model_len=160)
    session = ChatSession(llm, ChatSettings(temperature=0.0, max_tokens=20, ignore_eos=True))
    dropped = 0
    for i in range(6):
        dropped += session.reply(f"message number {i} about the capital of France",
                                 lambda d: None).dropped_turns
    assert dropped > 0
    assert session.history[-2]["content"] == "message number 5 about the capital of France"


# ---------------------------------------------------------------------- piped


def test_piped_two_turns_reset_and_prefix_hits(chat_model):
    script = b"hello there\nhow are you today?\n/reset\nhello there\n/stats\n"
    result = run_chat(chat_model, script, "--max-tokens", "6", "--system", "You are a test.")
    assert result.exit_code == 0, result.output
    replies = result.stdout.split("\n\n")
    assert replies[-1] == ""
    replies = replies[:-1]
    assert len(replies) == 3
    assert replies[0] == replies[2]  # after /reset the same message gets the same answer
    stats = re.findall(r"prefix cache (\d+)/(\d+) prompt tokens", result.stderr)
    assert len(stats) == 3
    assert int(stats[1][0]) > 0  # turn 2 reuses turn 1's blocks
    assert "conversation reset" in result.stderr
    assert "from prefix cache" in result.stderr and "Traceback" not in result.output
    assert "\x1b[" not in result.stdout  # plain text, no Rich markup


def test_piped_bad_command_continues_then_exits_1(chat_model):
    result = run_chat(chat_model, b"/temp -1\n/bogus\nhi\n", "--max-tokens", "2")
    assert result.exit_code == 1  # a script learns that not every line was taken
    assert "error: temperature must be >= 0" in result.stderr
    assert "error: unknown command /bogus" in result.stderr
    assert result.stdout.count("\n\n") == 1  # the message after the errors was answered


@pytest.mark.parametrize("bad", [
    b"\xff\xfe oops",  # not UTF-8 at all
    b"caf\xe9 au lait",  # Latin-1
    b"ends mid-character \xe2\x82",  # a truncated euro sign
])
def test_piped_non_utf8_line_is_reported_and_skipped(chat_model, bad):
    result = run_chat(chat_model, b"hi\r\n" + bad + b"\nhello there\n", "--max-tokens", "2")
    assert result.exit_code == 1, result.output  # after answering the rest
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: line 2 of the input is not valid "
                                                     "UTF-8 (byte "), errors
    assert errors[0].endswith("; skipped")
    assert result.stdout.count("\n\n") == 2  # lines 1 and 3 answered
    assert "Traceback" not in result.output


def test_piped_reply_cut_by_the_context_says_so(chat_model):
    # --max-tokens 500 is never reached: max-model-len 64 ends the reply first.
    result = run_chat(chat_model, b"hi\n", "--max-tokens", "500", "--ignore-eos",
                      "--max-model-len", "64")
    assert result.exit_code == 0, result.output
    assert "stopped at the context's end (max-model-len 64)" in result.stderr
    assert "stopped at max tokens" not in result.stderr
    result = run_chat(chat_model, b"hi\n", "--max-tokens", "3", "--ignore-eos",
                      "--max-model-len", "64")
    assert "stopped at max tokens" in result.stderr and "context" not in result.stderr


def test_piped_too_long_message_is_skipped_and_the_run_fails(chat_model):
    long = ("word " * 200).encode()
    result = run_chat(chat_model, long + b"\nhi\n", "--max-tokens", "2", "--max-model-len", "64")
    assert result.exit_code == 1, result.output
    assert "error: the message is" in result.stderr and "max-model-len is 64" in result.stderr
    assert result.stdout.count("\n\n") == 1  # "hi" still answered
    # Also when the script ends with /exit.
    result = run_chat(chat_model, b"hi\n" + long + b"\n/exit\nnever\n", "--max-tokens", "2",
                      "--max-model-len", "64")
    assert result.exit_code == 1 and result.stdout.count("\n\n") == 1


@pytest.mark.parametrize("command", [b"/exit", b"/quit", b"/exit now", b"  /quit please"])
def test_piped_exit_command(chat_model, command):
    result = run_chat(chat_model, command + b"\nnever answered\n", "--max-tokens", "2")
    assert result.exit_code == 0 and result.stdout == "", result.output


# ---------------------------------------------------------------------- terminal


def _spawn(model: Path, *args: str):
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "TERM": "xterm"}
    return pexpect.spawn(sys.executable, ["-m", "llmfast", "chat", "--model", str(model),
                                          *GREEDY, *args],
                         env=env, encoding="utf-8", codec_errors="replace", timeout=180,
                         dimensions=(50, 200))


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r\n", "\n")


def test_terminal_ctrl_c_mid_reply_then_correct_answer(chat_model):
    reference = run_chat(chat_model, b"hello there\n", "--max-tokens", "12")
    expected = reference.stdout.split("\n\n")[0]
    child = _spawn(chat_model, "--max-tokens", "100000", "--ignore-eos",
                   "--max-model-len", "4000", "--max-repeats", "0")  # no loop stop: ^C
    try:
        child.expect("you ›")
        child.sendline("hello there")
        child.expect("llm ›")
        child.expect(r"[\s\S]{20}", timeout=120)  # tokens are streaming (4000 take far longer)
        child.sendintr()
        child.expect("reply stopped")
        child.expect(r"(\d+) tokens")
        assert 0 < int(child.match.group(1)) < 3900  # stopped mid-reply
        child.expect("you ›")
        child.sendline("/max_tokens 12")
        child.expect("max_tokens = 12")
        child.expect("you ›")
        child.sendline("/ignore_eos off")
        child.expect("you ›")
        child.sendline("hello there")
        child.expect("llm ›")
        child.expect("TTFT")
        answer = _plain(child.before).removeprefix(" ").rstrip("\n")
        # The dropped turn left no trace: the answer is that of a fresh chat.
        assert answer == expected.rstrip("\n")
        _quit_at_prompt(child)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def _wait_for_line_read(child, timeout: float = 120.0) -> None:
    """Until the chat reads a line. The prompt is printed before the read starts, and a
    key sent in between can be lost; readline takes the terminal out of canonical mode
    when its read starts, which the pty's master side shows."""
    deadline = time.monotonic() + timeout
    while termios.tcgetattr(child.child_fd)[3] & termios.ICANON:
        if time.monotonic() > deadline or not child.isalive():
            pytest.fail(f"the chat never started reading a line: {child.before!r}")
        time.sleep(0.02)


def _quit_at_prompt(child) -> None:
    """Ctrl-D at the next prompt, once the chat reads it; the chat ends."""
    child.expect("you ›")
    _wait_for_line_read(child)
    child.sendcontrol("d")
    child.expect(pexpect_eof(), timeout=120)


def test_terminal_ctrl_c_at_prompt_exits_cleanly(chat_model):
    import pexpect

    child = _spawn(chat_model)
    try:
        child.expect("you ›")
        _wait_for_line_read(child)
        child.sendintr()  # once: a second ^C could land in the exit itself
        child.expect(pexpect.EOF, timeout=120)
    finally:
        child.close(force=True)
    assert child.signalstatus is None and child.exitstatus == 0, child.before
    assert "Traceback" not in (child.before or "")


def pexpect_eof():
    import pexpect

    return pexpect.EOF


def test_terminal_keys_typed_while_streaming_are_not_echoed_and_start_the_next_message(
        chat_model):
    child = _spawn(chat_model, "--max-tokens", "200", "--ignore-eos", "--max-repeats", "0")
    try:
        # The settings in use, once, before the first prompt.
        child.expect(r"sampling: temperature 0 \(flag\), top_k 40, .* no loop stop")
        child.expect("you ›")
        _wait_for_line_read(child)
        child.sendline("hello there")
        child.expect("llm ›")
        child.expect(r"[\s\S]{20}", timeout=120)  # streaming
        child.send("typed ahead")
        child.expect("TTFT", timeout=600)  # the reply ran to its end
        assert "typed ahead" not in child.before  # not echoed into the reply
        child.expect("you ›")
        _wait_for_line_read(child)
        child.expect("typed ahead", timeout=60)  # readline shows the held keys
        child.send("\r")
        child.expect("llm ›")  # ... and they were sent as the next message
        child.expect("TTFT", timeout=600)
        _quit_at_prompt(child)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0

"""How `hetplan` ends: any failure as one line on stderr and an exit status, 2 for what the user can fix (a
HetplanError, a usage error of click or typer, a file the system refuses, memory), 130 for Ctrl-C, 141 in silence when
the output's reader went away (`| head -1`, as shell tools end), 1 for a bug (with the traceback when HETPLAN_DEBUG is
set)."""

from __future__ import annotations

import contextlib
import difflib
import errno
import os
import re
import select
import stat
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click
import typer

from report import said

MISSPELLING_CUTOFF = 0.8  # difflib's ratio: '--ou' for '--out' (0.89) passes, '--tp' for '--cp' (0.75) not

if TYPE_CHECKING:
    from specs.errors import SpecError

DEBUG_HINT = "re-run with HETPLAN_DEBUG=1 for the traceback"
READER_GONE_STATUS = 141  # what a shell reports for a tool ended by SIGPIPE (128 + 13): `cat big | head -1`


def one_line(text: str, limit: int = 500) -> str:
    """A message as one line of at most `limit` characters (whitespace runs, newlines included, become a space); a
    longer one loses part of its middle, not its end, where a message lists the fields also wrong."""
    flat = " ".join(str(text).split())
    if len(flat) <= limit:
        return flat
    tail = limit // 3
    return flat[: limit - 3 - tail] + "..." + flat[-tail:]


def failure_line(
    err: BaseException, args: Sequence[str] = (), values: Sequence[tuple[str, str]] = ()
) -> tuple[str, int]:
    """The line and exit status for `err` (`args`: the command line, where a flag's bad value is found; `values`: its
    options' values, option_values). Usage errors are recognised by click's interface (`format_message`,
    `exit_code`) rather than by class: typer >= 0.29 vendors click, so its errors are not click's classes."""
    from specs.errors import HetplanError, SpecError  # here: specs loads pydantic, which `hetplan --help` does without

    if isinstance(err, SpecError):
        return f"hetplan: error: {one_line(_with_its_flag(err, values))}", 2
    if isinstance(err, HetplanError):
        return f"hetplan: error: {one_line(str(err))}", 2
    if hasattr(err, "format_message") and hasattr(err, "exit_code"):
        context = getattr(err, "ctx", None)
        command = getattr(context, "command_path", "") or "hetplan"
        return f"hetplan: error: {one_line(_usage_message(err, args))} (see '{command} --help')", 2
    if isinstance(err, OSError):
        where = f"{err.filename}: " if err.filename else ""
        return f"hetplan: error: {where}{one_line(err.strerror or str(err))}", 2
    if isinstance(err, MemoryError):
        return "hetplan: error: out of memory (the input asks for more than this machine has)", 2
    return f"hetplan: internal error: {type(err).__name__}: {one_line(str(err), 200)} ({DEBUG_HINT})", 1


def _with_its_flag(err: SpecError, values: Sequence[tuple[str, str]]) -> str:
    """A whole file's error (no field) with the option that named the file: `--cluster nope.yaml: file not found` (it
    named the file alone, and a newcomer with three files on the line looked for which); none where several options
    named it, or where the error names a flag already."""
    if err.field not in ("", "schema") or not err.source or err.source.startswith("-"):  # (schema: the file's kind)
        return str(err)
    flags = {flag for flag, value in values if value and Path(value) == Path(err.source)}
    return f"{flags.pop()} {err}" if len(flags) == 1 else str(err)


def option_values(app: typer.Typer, args: Sequence[str]) -> list[tuple[str, str]]:
    """The (long name, value) of each option given a value on the command line (`-c x.yaml`, `--cluster=x.yaml`);
    switches and positional arguments are not."""
    options, long_name = _options(app, args)
    valued = {name: long_name[name] for p in options if not getattr(p, "is_flag", False) for name in p.opts}
    given: list[tuple[str, str]] = []
    for index, token in enumerate(args):
        name, equals, value = token.partition("=")
        if equals and name.startswith("--") and name in valued:
            given.append((valued[name], value))
        elif token in valued and index + 1 < len(args):
            given.append((valued[token], args[index + 1]))
    return given


def _options(app: typer.Typer, args: Sequence[str]) -> tuple[list[click.Parameter], dict[str, str]]:
    """The options of the command `args` run, and the long name of each of their names."""
    options = [p for p in _command(app, args).params if p.param_type_name == "option"]
    return options, {o: next((n for n in p.opts if n.startswith("--")), o) for p in options for o in p.opts}


def _command(app: typer.Typer, args: Sequence[str]) -> click.Command:
    """The (sub)command `args` run."""
    command = typer.main.get_command(app)
    return getattr(command, "commands", {}).get(args[0], command) if args else command


def _created_directories() -> list[Path]:
    """The output directories this process's commands created (specs.outputs: none before it is imported)."""
    outputs = sys.modules.get("specs.outputs")
    return outputs.CREATED_DIRECTORIES if outputs is not None else []


def _remove_created_directories() -> None:
    """The output directories a failed command created and left empty."""
    if _created_directories():
        sys.modules["specs.outputs"].remove_created_directories()


def empty_argument(app: typer.Typer, args: list[str]) -> str | None:
    """The flag (or argument) given an empty value, else None: click reads `--cluster ''` as the path '.' (the
    current directory) and an empty name as a name; an empty value is never meant."""
    if "" not in args and not any(a.endswith("=") for a in args):
        return None
    options, long_name = _options(app, args)
    sub = _command(app, args)
    switches = {o for p in options if getattr(p, "is_flag", False) for o in (*p.opts, *p.secondary_opts)}
    arguments = [(p.metavar or p.name or "").upper() for p in sub.params if p.param_type_name == "argument"]
    for index, token in enumerate(args):
        if token.startswith("--") and token.endswith("=") and token[:-1] in long_name and token[:-1] not in switches:
            return long_name[token[:-1]]
        if token == "":
            before = args[index - 1] if index else ""
            if before in long_name and before not in switches:
                return long_name[before]
            return arguments[0] if arguments else None  # an extra argument: click names it
    return None


def _usage_message(err: BaseException, args: Sequence[str] = ()) -> str:
    """A usage error's message; a flag's bad value as the project's errors put it, `--flag: what is wrong, got
    'value'` (click says "Invalid value for '--flag': ..."; pydantic's wording of a flag's type names no value)."""
    from specs.errors import expected_wording

    names = list(getattr(getattr(err, "param", None), "opts", []))
    flags = [name for name in names if name.startswith("--")]
    message = expected_wording(str(getattr(err, "message", "")))
    if type(err).__name__ == "BadParameter" and flags and message:
        given = _given_value(args, names)
        got = f", got {given!r}" if given is not None and "got " not in message else ""
        return f"{flags[0]}: {message[:1].lower()}{message[1:]}{got}"
    missing = re.fullmatch(r"Option '(-[\w-]+)' requires an argument\.?", message)
    if missing:  # the option was the last word, or another option followed it
        return f"{missing[1]}: expected a value after it"
    if type(err).__name__ == "NoSuchOption":  # (typer's vendored click: by name, as above)
        return _no_such_option(getattr(err, "option_name", ""), getattr(err, "possibilities", None) or [])
    return str(err.format_message())  # type: ignore[attr-defined]


def _no_such_option(option: str, possibilities: Sequence[str]) -> str:
    """The unknown option and the command's options it may be a misspelling of: click's own guess is loose (`predict
    --out` offered --group, --recompute and --tp)."""
    close = difflib.get_close_matches(option, possibilities, n=3, cutoff=MISSPELLING_CUTOFF)
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in option)  # no terminal escapes from argv
    return f"No such option: {shown}" + (f" (did you mean {' or '.join(close)}?)" if close else "")


def _given_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value an option was given last on the command line (`--tp x8`, `--tp=x8`, `-m x`), None when not found."""
    given = None
    for index, arg in enumerate(args):
        if arg == "--":
            break
        if arg in names and index + 1 < len(args):
            given = args[index + 1]
        elif "=" in arg and arg.split("=", 1)[0] in names:
            given = arg.split("=", 1)[1]
    return given


def exit_status(app: typer.Typer, args: list[str]) -> int:
    """Run the typer `app` on `args` (its own exit handling off) and return the exit status, printing at most one
    line on stderr: the failure, 'interrupted' (a Ctrl-C anywhere, also one typer turned into exit 130), with no
    arguments the commands there are, and nothing when the output's reader went away (141)."""
    try:
        if not args:
            names = ", ".join(c.name or getattr(c.callback, "__name__", "") for c in app.registered_commands)
            print(f"hetplan: error: missing command: one of {names} (see 'hetplan --help')", file=sys.stderr)
            return 2
        _created_directories().clear()  # an earlier command's (in this process) are not this one's
        null_before = stdout_is_null()  # the caller's `> /dev/null`, not rich's after a broken pipe
        try:
            empty = empty_argument(app, args)
            if empty is not None:
                print(f"hetplan: error: {empty}: expected a value, got '' (an empty argument)", file=sys.stderr)
                return 2
            code = app(args=args, prog_name="hetplan", standalone_mode=False)
        except (KeyboardInterrupt, click.exceptions.Abort, typer.Abort):  # Ctrl-C, or EOF at a prompt
            said.drop()
            code = 130
        except SystemExit as ended:  # typer ends a command on any broken pipe so, exit 1 in silence
            broken = ended.__context__
            if not (isinstance(broken, OSError) and broken.errno == errno.EPIPE):
                raise
            if output_reader_gone(null_before):
                raise BrokenPipeError from broken  # the reader's choice, not a failure: below
            return reported(broken)  # a peer's socket, say
        except Exception as err:  # the one place every failure becomes a line
            return reported(err, args, option_values(app, args))
        if code in (None, 0):
            said.flush()  # a success that showed nothing (--quiet, files only) says its notes at the end
        else:
            said.drop()
            _remove_created_directories()
        if code == 130:
            print("hetplan: interrupted", file=sys.stderr)
        sys.stdout.flush()  # a piped output's last block: its reader may have gone (below)
        return code if isinstance(code, int) else 0
    except KeyboardInterrupt:  # while printing the line
        return 130
    except BrokenPipeError:  # the output's reader went away (`hetplan plan ... | head -1`): what is written stays
        with contextlib.suppress(OSError, ValueError):  # the exit's flush of the rest goes nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return READER_GONE_STATUS


def reported(err: BaseException, args: Sequence[str] = (), values: Sequence[tuple[str, str]] = ()) -> int:
    """Report a command's failure `err` in one line (and its traceback with HETPLAN_DEBUG) and undo what it began;
    its exit status (`values`: the options' values, option_values)."""
    said.drop()
    _remove_created_directories()
    if os.environ.get("HETPLAN_DEBUG", "") not in ("", "0"):
        traceback.print_exception(err)
    line, code = failure_line(err, args, values)
    print(line, file=sys.stderr)
    return code


def output_reader_gone(null_before: bool) -> bool:
    """Standard output is a pipe (or socket) whose reading end is closed, or was one: rich, on a broken pipe, points
    stdout at the null device (which never breaks), so stdout there now and not before the command (`null_before`)
    counts too. A broken pipe there is the reader's choice, elsewhere (a peer's socket) a failure."""
    if stdout_is_null():
        return not null_before
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no file behind stdout
        return False


def stdout_is_null() -> bool:
    """Standard output is the null device (`> /dev/null`, or rich's after a broken pipe)."""
    try:
        found, null = os.fstat(sys.stdout.fileno()), os.stat(os.devnull)
    except (AttributeError, OSError, ValueError):  # no file behind stdout
        return False
    return stat.S_ISCHR(found.st_mode) and found.st_rdev == null.st_rdev

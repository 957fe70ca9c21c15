"""Readers for the deployment files, following the rules of the tools that read them:
the Dockerfile's instructions and stages, .dockerignore's patterns (moby's
patternmatcher), and compose's `${VAR:-default}` interpolation."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

# ------------------------------------------------------------------------- Dockerfile


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, ENV, ...
    args: str  # the rest of the logical line, continuation lines joined
    line: int  # 1-based line of the keyword


@dataclass
class Stage:
    base: str  # as written, ${ARG}s unexpanded
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    global_args: dict[str, str]  # ARGs before the first FROM, with their defaults
    stages: list[Stage]
    pragmas: list[tuple[int, str]]  # (line, text) of `# hadolint ...` comments

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        global_args: dict[str, str] = {}
        stages: list[Stage] = []
        pragmas: list[tuple[int, str]] = []
        for ins in _logical_lines(path.read_text(), pragmas):
            if ins.keyword == "FROM":
                words = ins.args.split()
                name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
                stages.append(Stage(base=words[0], name=name))
            elif not stages:
                if ins.keyword == "ARG":
                    key, _, value = ins.args.partition("=")
                    global_args[key.strip()] = value.strip()
            else:
                stages[-1].instructions.append(ins)
        return cls(global_args, stages, pragmas)

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage named {name!r}")

    def expand(self, text: str, **args: str) -> str:
        """`${NAME}` and `$NAME` replaced with the global ARGs (overridden by `args`)."""
        values = {**self.global_args, **args}
        return re.sub(
            r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text
        )

    def chain(self, stage_name: str, **args: str) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first."""
        stage = self.stage(stage_name)
        chain = [stage]
        names = {s.name for s in self.stages}
        while (base := self.expand(stage.base, **args)) in names:
            stage = self.stage(base)
            chain.append(stage)
        return chain


def _logical_lines(text: str, pragmas: list[tuple[int, str]]) -> list[Instruction]:
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#"):
            if stripped[1:].strip().startswith("hadolint"):
                pragmas.append((number, stripped[1:].strip()))
            continue  # comments inside a continued instruction are dropped, as Docker does
        if not stripped and not pending:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        logical = " ".join(p for p in pending if p)
        pending = []
        keyword, _, args = logical.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    return out


def exec_form(args: str) -> list[str]:
    """The JSON array of an exec-form ENTRYPOINT, CMD or HEALTHCHECK CMD."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def env_pairs(args: str) -> dict[str, str]:
    """ENV K=V [K2=V2 ...] (the form the Dockerfile uses)."""
    pairs = {}
    for word in shlex.split(args):
        key, sep, value = word.partition("=")
        assert sep, f"ENV {args!r}: use the K=V form"
        pairs[key] = value
    return pairs


def healthcheck(args: str) -> tuple[dict[str, str], list[str]]:
    """HEALTHCHECK [--option=value ...] CMD [json]: the options and the command."""
    options_text, sep, command = args.partition("CMD ")
    assert sep, f"HEALTHCHECK {args!r}: no CMD"
    options = dict(o.lstrip("-").split("=", 1) for o in options_text.split())
    return options, exec_form(command)


# ---------------------------------------------------------------------- .dockerignore


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """moby/patternmatcher: `*` and `?` stop at '/', `**` spans directories."""
    out = "^"
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if i < len(pattern) and pattern[i] == "/":
                i += 1
            out += ".*" if i >= len(pattern) else "(.*/)?"
            continue
        if ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "[":
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out + "$")


def dockerignore_filter(text: str):
    """A predicate: is a context path (relative, '/'-separated) sent to the builder?"""
    rules: list[tuple[bool, re.Pattern[str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        pattern = re.sub(r"/+", "/", pattern).removeprefix("./")
        rules.append((exclude, _pattern_regex(pattern)))

    def included(path: str) -> bool:
        parts = path.split("/")
        parents = ["/".join(parts[:i]) for i in range(1, len(parts))]
        excluded = False
        for exclude, regex in rules:
            # A pattern applies to the path or to any of its parent directories.
            if regex.match(path) or any(regex.match(p) for p in parents):
                excluded = exclude
        return not excluded

    return included


# ---------------------------------------------------------------------------- compose

_INTERPOLATION = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${VAR}, ${VAR:-default}, ${VAR-default}, $$."""

    def substitute(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        if op in (":?", "?"):
            assert name in env, f"${{{name}}} is required: {default}"
        return env.get(name, "")

    return _INTERPOLATION.sub(substitute, value)


def interpolate_tree(value: object, env: dict[str, str]) -> object:
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, dict):
        return {k: interpolate_tree(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate_tree(v, env) for v in value]
    return value


# ----------------------------------------------------------------------------- README


@dataclass
class Block:
    lang: str  # the info string's first word: bash, python, json, ...
    body: str
    line: int  # 1-based line of the opening fence
    section: str  # the nearest `## ` heading above it

    def commands(self) -> list[str]:
        """The block's commands: lines joined at trailing backslashes, comments and
        heredoc bodies kept with their command."""
        out: list[str] = []
        pending = ""
        heredoc: str | None = None
        for line in self.body.splitlines():
            if heredoc is not None:
                out[-1] += "\n" + line
                if line.strip() == heredoc:
                    heredoc = None
                continue
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending += line
            if pending.endswith("\\"):
                pending = pending[:-1] + "\n"
                continue
            out.append(pending)
            if match := re.search(r"<<-?\s*'?\"?(\w+)'?\"?", pending):
                heredoc = match.group(1)
            pending = ""
        return out


def readme_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    section = ""
    fence: tuple[str, int, list[str]] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if fence is not None:
            if line.startswith("```"):
                blocks.append(Block(fence[0], "\n".join(fence[2]) + "\n", fence[1], section))
                fence = None
            else:
                fence[2].append(line)
        elif line.startswith("```"):
            fence = (line[3:].strip().split(" ")[0], number, [])
        elif line.startswith("## "):
            section = line[3:].strip()
    assert fence is None, f"README.md: the block at line {fence[1]} is never closed"
    return blocks

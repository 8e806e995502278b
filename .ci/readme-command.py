#!/usr/bin/env python3
"""Prints a command from README.md, read at run time so that CI runs what a reader copies.

    readme-command.py README.md first          # first command of the first code block
    readme-command.py README.md after TEXT     # first command of the first code block whose
                                               # first command contains TEXT, then its next ones:
    readme-command.py README.md after TEXT 2   # ... the 2nd command of that block

A command is a non-blank, non-comment line of a fenced code block, joined with the lines its
trailing backslashes continue; a trailing `# ...` comment is kept (bash ignores it).
"""
import sys


def blocks(text):
    block, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if inside:
                yield block
                block = []
            inside = not inside
        elif inside:
            block.append(line)


def commands(block):
    out, pending = [], ""
    for line in block:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def main():
    path, mode = sys.argv[1], sys.argv[2]
    found = [c for c in (commands(b) for b in blocks(open(path, encoding="utf-8").read())) if c]
    if mode == "first":
        if not found:
            sys.exit(f"{path}: no command in any code block")
        print(found[0][0])
        return
    if mode == "after":
        needle, index = sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 1
        for cmds in found:
            if needle in cmds[0]:
                if index > len(cmds):
                    sys.exit(f"{path}: the block starting with {needle!r} has {len(cmds)} commands")
                print(cmds[index - 1])
                return
        sys.exit(f"{path}: no code block starts with a command containing {needle!r}")
    sys.exit(f"unknown mode {mode!r}")


main()

#!/usr/bin/env python3
"""Every relative link in the README and docs/ names a file that exists and, with #anchor, a
heading of it (GitHub's anchors: lower case, punctuation dropped, spaces to hyphens)."""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path):
    seen, out = {}, set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def main():
    bad = []
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in files:
        in_code = False
        for no, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                dest = (doc.parent / file).resolve() if file else doc
                if not dest.exists():
                    bad.append(f"{doc.relative_to(ROOT)}:{no}: {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    bad.append(f"{doc.relative_to(ROOT)}:{no}: {target}: no such heading")
    for b in bad:
        print(b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

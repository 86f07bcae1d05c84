#!/usr/bin/env python3
"""Print the slowest tests of a cargo-nextest JUnit report (make test runs it after the tests).

    slowest-tests.py [REPORT] [COUNT] [--only BINARY | --not BINARY]
"""
import sys
import xml.etree.ElementTree as ET

args = sys.argv[1:]
which = None
for flag in ("--only", "--not"):
    if flag in args:
        i = args.index(flag)
        which = (flag, args[i + 1])
        del args[i:i + 2]
path = args[0] if args else "target/nextest/default/junit.xml"
count = int(args[1]) if len(args) > 1 else 10
try:
    root = ET.parse(path).getroot()
except (OSError, ET.ParseError) as e:
    print(f"no test times ({path}: {e})")
    sys.exit(0)


def chosen(classname):
    """nextest names a test's class `crate::binary`."""
    if which is None:
        return True
    binary = classname.rsplit("::", 1)[-1]
    return (binary == which[1]) == (which[0] == "--only")


cases = [
    (float(c.get("time", "0")), f"{c.get('classname', '')} {c.get('name', '')}".strip())
    for c in root.iter("testcase") if chosen(c.get("classname", ""))
]
cases.sort(reverse=True)
total = sum(seconds for seconds, _ in cases)
wall = float(root.get("time", "0") or 0)
print(f"slowest {min(count, len(cases))} of {len(cases)} tests ({total:.0f} s of test time; "
      f"the whole run took {wall:.0f} s):")
for seconds, name in cases[:count]:
    print(f"  {seconds:7.1f} s  {name}")

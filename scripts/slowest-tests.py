#!/usr/bin/env python3
"""Print the slowest tests of a cargo-nextest JUnit report (make test runs it after the tests)."""
import sys
import xml.etree.ElementTree as ET

path = sys.argv[1] if len(sys.argv) > 1 else "target/nextest/default/junit.xml"
count = int(sys.argv[2]) if len(sys.argv) > 2 else 10
try:
    root = ET.parse(path).getroot()
except (OSError, ET.ParseError) as e:
    print(f"no test times ({path}: {e})")
    sys.exit(0)
cases = [
    (float(c.get("time", "0")), f"{c.get('classname', '')} {c.get('name', '')}".strip())
    for c in root.iter("testcase")
]
total = float(root.get("time", "0") or 0)
cases.sort(reverse=True)
print(f"slowest {min(count, len(cases))} of {len(cases)} tests ({total:.0f} s in all, wall clock):")
for seconds, name in cases[:count]:
    print(f"  {seconds:7.1f} s  {name}")

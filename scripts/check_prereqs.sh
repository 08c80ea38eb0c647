#!/usr/bin/env bash
# Fails early, with the fix, when the machine lacks what the set-up needs.
set -u
fail=0
say() { echo "check_prereqs: $*" >&2; fail=1; }

py=${1:-python3}
"$py" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 11) else 1)' 2>/dev/null \
  || say "Python >= 3.11 is needed ($py is $("$py" --version 2>&1)); set PYTHON=/path/to/python3.11."
if command -v java >/dev/null; then
  major=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n 1)
  [ "${major:-0}" -ge 17 ] || say "Java 17+ is needed by pyspark 4 (found Java ${major:-?}); install openjdk-17 and set JAVA_HOME."
else
  say "Java 17+ is needed by pyspark 4 and none is on PATH; install openjdk-17-jre-headless (Debian) and set JAVA_HOME."
fi
command -v g++ >/dev/null || say "a C++17 compiler is needed to build horovod; install g++ (Debian: apt-get install g++)."
command -v cmake >/dev/null || say "cmake is needed to build horovod; install it (Debian: apt-get install cmake)."
exit $fail

#!/usr/bin/env bash
# What one durable commit costs this disk, with no database at all: rounds of `pages` 4 KiB
# pwrite calls and one fdatasync, on a pre-written 256 MiB file (so no round extends it), with
# the pages placed three ways: contiguous, scattered within a 512 KiB window (where redb's
# copy-on-write commits put most of theirs: seen with strace), and scattered over the file.
# Prints wall time and this process's CPU (user + system) per round. The store's commits
# write ~20 pages each (docs/BENCHMARKS.md); this is the floor under their cost on this disk.
# Usage: scripts/bench-disk.sh [DIR=./data] [ROUNDS=1500]
set -euo pipefail
dir=${1:-./data}
rounds=${2:-1500}
mkdir -p "$dir"
python3 - "$dir/bench-disk.tmp" "$rounds" <<'PY'
import os, random, resource, sys, time

path, rounds = sys.argv[1], int(sys.argv[2])
PAGE, FILE_PAGES = 4096, 65536

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def run(pages, placement):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        zeros = b"\0" * (1 << 20)
        for _ in range(FILE_PAGES * PAGE >> 20):
            os.write(fd, zeros)
        os.fdatasync(fd)
        buf = os.urandom(PAGE)
        rng = random.Random(7)
        c0, t0 = cpu(), time.perf_counter()
        for _ in range(rounds):
            if placement == "contiguous":
                base = rng.randrange(FILE_PAGES - pages)
                offs = range(base, base + pages)
            elif placement == "512k-window":
                base = rng.randrange(FILE_PAGES - 128)
                offs = [base + o for o in rng.sample(range(128), pages)]
            else:
                offs = rng.sample(range(FILE_PAGES), pages)
            for o in offs:
                os.pwrite(fd, buf, o * PAGE)
            os.fdatasync(fd)
        wall, used = time.perf_counter() - t0, cpu() - c0
    finally:
        os.close(fd)
        os.unlink(path)
    print(f"{pages:3d} pages {placement:12s} {wall / rounds * 1e6:7.0f} us wall "
          f"{used / rounds * 1e6:7.0f} us cpu per commit")

for pages in (1, 10, 20, 40):
    run(pages, "512k-window")
for placement in ("contiguous", "whole-file"):
    run(20, placement)
PY

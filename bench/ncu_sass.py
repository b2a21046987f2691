"""Where a launch's time goes inside its programs, from an ncu report with source-level (SASS)
stall samples: the launch's figures (duration, grid, executed instructions, cycles a warp waits
between its instructions, occupancy), the stall reasons' shares of the samples, and the code's
segments (runs of consecutive instructions executed the same number of times: a loop body, a
prologue, the last program's tail) with their instructions a warp and their share of the samples.

The reports, on the device (one launch of each kernel in the layer step at B1 32K):
    ncu --launch-skip 60 --launch-count 1 -k regex:_score_kernel --set full --import-source yes \
        -o score python3 bench/step_profile.py --shapes 1x32768
    ncu -i score.ncu-rep --page source --csv --print-source sass > score-sass.csv
    ncu -i score.ncu-rep --print-details all > score.txt
then: python3 bench/ncu_sass.py --report score=score-sass.csv,score.txt [--report ...] --json OUT
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import Counter

DETAILS = {
    "duration_us": r"^\s+Duration\s+us\s+([\d.,]+)",
    "sm_ghz": r"^\s+SM Frequency\s+Ghz\s+([\d.,]+)",
    "grid": r"^\s+Grid Size\s+([\d.,]+)",
    "block": r"^\s+Block Size\s+([\d.,]+)",
    "registers": r"^\s+Registers Per Thread\s+register/thread\s+([\d.,]+)",
    "executed_instructions": r"^\s+Executed Instructions\s+inst\s+([\d.,]+)",
    "warp_cycles_per_instruction": r"^\s+Warp Cycles Per Issued Instruction\s+cycle\s+([\d.,]+)",
    "achieved_occupancy_pct": r"^\s+Achieved Occupancy\s+%\s+([\d.,]+)",
}


def details(text: str) -> dict[str, float]:
    """The first value of each DETAILS figure in `ncu --print-details all` output."""
    out = {}
    for key, pattern in DETAILS.items():
        got = re.search(pattern, text, re.MULTILINE)
        if got:
            out[key] = float(got[1].replace(",", ""))
    return out


def _int(cell: str) -> int:
    return int(cell) if cell.isdigit() else 0


def sass_summary(rows: list[list[str]], warps: int, min_share: float = 0.02) -> dict:
    """Stall reasons and segments of the source page's SASS rows (header first)."""
    header, data = rows[0], rows[1:]
    samples_at = header.index("Warp Stall Sampling (All Samples)")
    source_at = header.index("Source")
    executed_at = header.index("Instructions Executed")
    reasons = {
        h.removeprefix("stall_"): i
        for i, h in enumerate(header)
        if h.startswith("stall_") and "Not Issued" not in h
    }
    total = sum(_int(r[samples_at]) for r in data) or 1
    stalls = {name: sum(_int(r[i]) for r in data) / total for name, i in reasons.items()}
    segments: list[dict] = []
    for r in data:
        executed, samples = _int(r[executed_at]), _int(r[samples_at])
        words = r[source_at].split()
        if words and words[0].startswith("@"):  # a predicate guard: the opcode follows
            words = words[1:]
        opcode = (words or [""])[0].split(".")[0]
        if segments and segments[-1]["executed"] == executed:
            seg = segments[-1]
        else:
            seg = {"executed": executed, "instructions": 0, "samples": 0, "opcodes": Counter()}
            segments.append(seg)
        seg["instructions"] += 1
        seg["samples"] += samples
        seg["opcodes"][opcode] += 1
    kept = []
    for seg in segments:
        share = seg["samples"] / total
        if seg["executed"] == 0 or (share < min_share and seg["instructions"] < 50):
            continue
        kept.append(
            {
                "instructions": seg["instructions"],
                "executions_a_warp": round(seg["executed"] / warps, 3),
                "sample_share": round(share, 4),
                "top_opcodes": dict(seg["opcodes"].most_common(5)),
            }
        )
    return {
        "samples": total,
        "stall_shares": {
            k: round(v, 4) for k, v in sorted(stalls.items(), key=lambda kv: -kv[1]) if v >= min_share
        },
        "segments": kept,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", action="append", required=True, help="name=SASS_CSV,DETAILS_TXT")
    p.add_argument("--what", default="")
    p.add_argument("--json")
    a = p.parse_args()
    out = {"what": a.what, "rows": []}
    for item in a.report:
        name, _, paths = item.partition("=")
        sass_path, details_path = paths.split(",")
        with open(details_path) as f:
            row = {"kernel": name, **details(f.read())}
        with open(sass_path, newline="") as f:
            rows = [r for r in csv.reader(f) if r]
        start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")  # after the kernel's name line
        warps = int(row["grid"] * row["block"] // 32)
        row["warps"] = warps
        row["instructions_a_warp"] = round(row["executed_instructions"] / warps, 1)
        row |= sass_summary(rows[start:], warps)
        out["rows"].append(row)
        top = ", ".join(f"{k} {v:.0%}" for k, v in list(row["stall_shares"].items())[:4])
        print(
            f"{name:14s} {row['duration_us']:6.2f} us at {row['sm_ghz']:.2f} GHz, {warps} warps, "
            f"{row['instructions_a_warp']:.0f} instructions a warp at "
            f"{row['warp_cycles_per_instruction']:.1f} cycles | {top}"
        )
        for seg in row["segments"]:
            print(
                f"    {seg['instructions']:4d} instructions x {seg['executions_a_warp']:.2f} a warp, "
                f"{seg['sample_share']:.0%} of samples: {seg['top_opcodes']}"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

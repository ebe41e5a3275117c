"""Count the SASS instructions of the loops that contain HGMMA, per instruction class (round 15, issue #50).

    python docs/scripts/sass_loop_counts.py KERNEL.sass [--lines] [--show]
    python docs/scripts/sass_loop_counts.py KERNEL.sass --groups WEIGHTS_PER_THREAD_PER_ITERATION

KERNEL.sass: ``nvdisasm -c`` (or ``cuobjdump -sass``) output. A loop is a backward branch ``BRA `(.L_x_N)`` whose
target label lies above it; the loops whose body (label .. branch, the out-of-line retry blocks of mbarrier waits not
included) holds an HGMMA are reported innermost only, with counts per class (opcode stem: predicate and modifiers
stripped, except that bf16x2/f16x2 ops and conversions keep their kind).
"""

import collections
import re
import sys

CLASSES = [
    ("HGMMA", r"^HGMMA"), ("WARPGROUP", r"^WARPGROUP"), ("LOP3", r"^LOP3"), ("PRMT", r"^PRMT"), ("SHF", r"^SHF"),
    ("SHL/SHR", r"^(SHL|SHR)"), ("IMAD/IADD3/LEA", r"^(IMAD|IADD3|IADD|LEA|IABS|IMNMX|VIMNMX)"),
    ("HMUL2/HFMA2/HADD2", r"^(HMUL2|HFMA2|HADD2)"), ("F2FP/I2F/F2F", r"^(F2FP|I2F|F2F|F2I|I2FP)"),
    ("LDS", r"^LDS"), ("LDSM", r"^LDSM"), ("STS", r"^STS"), ("SYNCS", r"^SYNCS"), ("BAR", r"^BAR"),
    ("ISETP/SEL", r"^(ISETP|SEL|FSEL|PLOP3|P2R|R2P)"), ("MOV", r"^MOV"), ("uniform (U*, R2UR)", r"^(U|R2UR)"),
    ("BRA/control", r"^(BRA|BSSY|BSYNC|WARPSYNC|NOP|YIELD|EXIT|CALL|RET|ELECT)"), ("FFMA/FMUL/FADD", r"^(FFMA|FMUL|FADD)"),
    ("S2R/CS2R/S2UR", r"^(S2R|CS2R|S2UR)"), ("LDG/STG", r"^(LDG|STG)"), ("FENCE/MEMBAR", r"^(FENCE|MEMBAR|CCTL)"),
]
SRC = re.compile(r'//## File "([^"]+)", line (\d+)')
LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*?);")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRA = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


def klass(op: str) -> str:
    for name, pat in CLASSES:
        if re.match(pat, op):
            return name
    return "other:" + op.split(".")[0]


def parse(path):
    insts, labels, src = [], {}, "?"
    for ln in open(path):
        m = SRC.search(ln)
        if m:  # nvdisasm -g: the source line of the instructions that follow
            src = f"{m.group(1).split('/')[-1]}:{m.group(2)}"
            continue
        m = LABEL.match(ln.strip())
        if m:
            labels[m.group(1)] = len(insts)
            continue
        m = LINE.match(ln)
        if m:
            insts.append((int(m.group(1), 16), m.group(2), m.group(3).strip(), ln.rstrip(), src))
    return insts, labels


def loops(insts, labels):
    out = []
    for i, (_, _op, _rest, line, _src) in enumerate(insts):
        m = BRA.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            body = insts[labels[m.group(1)]: i + 1]
            if any(b[1].startswith("HGMMA") for b in body):
                out.append((labels[m.group(1)], i, body))
    # innermost only: drop a loop that contains another HGMMA loop
    return [lp for lp in out if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] for o in out)]


def count(body):
    c = collections.Counter(klass(b[1]) for b in body)
    ops = collections.Counter(b[1] for b in body)
    return c, ops


if __name__ == "__main__" and "--groups" not in sys.argv:
    insts, labels = parse(sys.argv[1])
    for a, b, body in loops(insts, labels):
        c, ops = count(body)
        print(f"loop {hex(insts[a][0])}..{hex(insts[b][0])}: {len(body)} instructions")
        for name, _ in CLASSES:
            if c.get(name):
                print(f"  {name:22s} {c[name]}")
        for k in sorted(k for k in c if k.startswith("other:")):
            print(f"  {k:22s} {c[k]}")
        print("  opcodes:", dict(sorted(ops.items(), key=lambda t: -t[1])))
        if "--lines" in sys.argv:  # per source line (nvdisasm -g): instructions and their opcodes
            per = collections.defaultdict(collections.Counter)
            for b in body:
                per[b[4]][b[1]] += 1
            for srcl, cc in sorted(per.items(), key=lambda t: -sum(t[1].values())):
                print(f"    {srcl:40s} {sum(cc.values()):4d}  {dict(cc.most_common())}")
        if "--show" in sys.argv:
            print("\n".join(x[3] for x in body))


# --groups: the loop's instructions by what they do, from nvdisasm -g's source lines (round 15's tables)
GROUPS = {
    # ours: packages/nvfp4/src/nvfp4/kernels/hopper_ws.py (tree at the commit of round 15)
    "hopper_ws.py:38": "E2M1 -> bf16 (bits)",
    "hopper_ws.py:47": "scale multiply (HMUL2)",
    "hopper_ws.py:63": "scale fetch + FP8 -> bf16", "hopper_ws.py:64": "scale fetch + FP8 -> bf16",
    "hopper_ws.py:104": "scale fetch + FP8 -> bf16", "hopper_ws.py:117": "scale fetch + FP8 -> bf16",
    "hopper_ws.py:118": "scale fetch + FP8 -> bf16", "standard.py:263": "scale fetch + FP8 -> bf16",
    "hopper_ws.py:114": "weight LDS",
    # Humming 0.1.19: humming/include/humming/...
    "dequant.cuh:35": "E2M1 -> bf16 (bits)", "dequant_single.cuh:116": "E2M1 -> bf16 (bits)",
    "math.cuh:18": "E2M1 -> bf16 (bits)",
    "cuda_fp16.hpp:980": "scale fetch + FP8 -> bf16", "dequant_native.cuh:92": "scale fetch + FP8 -> bf16",
    "cuda_bf16.hpp:572": "scale fetch + FP8 -> bf16", "loader_bs.cuh:193": "scale fetch + FP8 -> bf16",
    "loader_b.cuh:140": "weight LDS",
}
ALU = re.compile(r"^(LOP3|SHF|PRMT|SEL|ISETP|IADD3|LEA|IABS|PLOP3|SHL|SHR|FLO|POPC|BREV)")  # the INT (ALU) pipe
FMAH = re.compile(r"^IMAD")  # integer multiply-add: the FMA-heavy pipe


def groups(body):
    out = collections.defaultdict(collections.Counter)
    for b in body:
        g = GROUPS.get(b[4])
        op = b[1]
        if op.startswith("HGMMA") or op.startswith("WARPGROUP"):
            g = "HGMMA + WARPGROUP"
        elif b[4] == "cuda_bf16.hpp:2590":  # __hmul2: by a register scale or by the constant 2^124 (re-bias)
            g = "E2M1 re-bias (HMUL2 by 2^124)" if re.search(r"\de\+37", b[3]) else "scale multiply (HMUL2)"
        elif g is None:
            g = "pipeline, loop, descriptors"
        out[g][op] += 1
    return out


if __name__ == "__main__" and "--groups" in sys.argv:
    w = int(sys.argv[sys.argv.index("--groups") + 1])  # decoded weights per thread per loop iteration
    insts, labels = parse(sys.argv[1])
    for a, _b, body in loops(insts, labels)[:1]:
        print(f"groups of loop {hex(insts[a][0])}: per iteration | per weight (of {w} per thread)")
        tot = alu = fmah = 0
        for g, cc in sorted(groups(body).items()):
            n = sum(cc.values())
            na = sum(v for k, v in cc.items() if ALU.match(k))
            nf = sum(v for k, v in cc.items() if FMAH.match(k))
            tot, alu, fmah = tot + n, alu + na, fmah + nf
            print(f"  {g:32s} {n:5d} {n / w:6.3f}  ALU {na:4d} IMAD {nf:4d}  {dict(cc.most_common(6))}")
        print(f"  {'total':32s} {tot:5d} {tot / w:6.3f}  ALU {alu:4d} ({alu / w:.3f}/w) IMAD {fmah:4d} ({fmah / w:.3f}/w)")

"""Where code outside captioner/io/checkpoint.py reads a checkpoint by key: a subscript or a
``.get`` with a key of the checkpoint file (top level, its train_state, its weight average) on
a name that holds one, at a git revision: how far the typed record reaches, before and after
it; writes (``x["k"] = ...``) are not counted, and it cannot tell a metrics line's
``last["step"]`` from a checkpoint's: read the lines it lists.

    python tools/checkpoint_reads.py [REVISION]     # default HEAD
"""

from __future__ import annotations

import re
import subprocess
import sys

FOLDERS = ("captioner", "train", "studies", "app", "benchmarks")
KEYS = ("format|version|model_config|vocab|tokenizer|preprocess|state_dict|meta|train_state|familiarity|demo|"
        "step|epoch|batch_in_epoch|best|bad_vals|validated_at|train_seconds|optimizer|scheduler|rng|rng_per_rank|"
        "config|grad_scaler|weight_average|baseline|hard|scst|tensors|decay|updates")
HOLDERS = r"(ckpt|last|best|src|ts|train_state|average|state|out|saved|checkpoint|\)|\])"
READ = re.compile(HOLDERS + r'(\[\s*"(' + KEYS + r')"\s*\]|\.get\(\s*"(' + KEYS + r')")')


def reads(rev: str) -> list[str]:
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev], capture_output=True, text=True,
                           check=True).stdout.split()
    found = []
    for name in names:
        if not name.endswith(".py") or name.split("/")[0] not in FOLDERS or name == "captioner/io/checkpoint.py":
            continue
        text = subprocess.run(["git", "show", f"{rev}:{name}"], capture_output=True, text=True, check=True).stdout
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("#")[0]
            for m in READ.finditer(code):
                after = code[m.end():].lstrip()
                if not (after.startswith("=") and not after.startswith("==")):
                    found.append(f"{name}:{n}: {line.strip()}")
    return found


if __name__ == "__main__":
    lines = reads(sys.argv[1] if len(sys.argv) > 1 else "HEAD")
    print("\n".join(lines))
    print(f"{len(lines)} reads in {len({line.split(':')[0] for line in lines})} files")

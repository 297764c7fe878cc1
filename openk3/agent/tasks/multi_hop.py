"""`multi_hop` (agent domain, background §3.2 A3): multi-hop retrieval across notes files to a key-value store
entry, with decoy owners at every hop. A family of `openk3.agent.tasks` (`Family`, `build(rng, difficulty,
template)`, the grader protocol of base.py); its scripted expert is in posttrain's agentic traces.
"""

from __future__ import annotations

import json
import random

from openk3.agent.tasks.base import GRADER_PRELUDE, Call, Family, Task, register
from openk3.agent.tasks.tool_arith import KV_PATH, kv_file

# ---- multi_hop (A3): multi-hop retrieval, a task family registered with openk3.agent.tasks ----------------
#
# The workspace holds notes/*.md files and a key-value store. The instruction names a start file and an owner
# ("project apollo"); each file on the owner's chain says which file to read next for that owner, beside lines
# for other owners that lead to decoy files and decoy keys; the last file names the KV key holding the answer.
# Difficulty 1-3: 1-3 files, then the key (2-4 hops). Reward 1.0 iff the submitted number is the owner's.

HOP_TEMPLATES = {"supplier": ("supplier code", "project"), "door": ("door code", "team"),
                 "incident": ("incident number", "service")}  # the last one is held out
HOP_OWNERS = ("apollo", "borealis", "cobalt", "delta", "ember", "fjord", "granite", "helix", "iris", "juniper",
              "krypton", "lumen")
HOP_WORDS = ("memo", "brief", "plan", "log", "digest", "minutes", "ledger", "summary", "draft", "record", "index",
             "report", "handover", "review")
HOP_FILLER = ("Nothing else here changed since the last review.", "Kept for reference; ask the owners for edits.",
              "Figures are checked monthly.", "Older entries were archived.")
HOP_GRADE = GRADER_PRELUDE + '''\
with open("/grader/expected.json") as f:
    expected = json.load(f)["answer"]
finish(1.0 if ANSWER is not None and parse_number(ANSWER) == expected else 0.0)
'''


def _hop_build(rng: random.Random, difficulty: int, template: str) -> dict:
    what, kind = HOP_TEMPLATES[template]
    owner, *rivals = (f"{kind} {o}" for o in rng.sample(HOP_OWNERS, 3))
    names = [f"notes/{w}_{rng.randint(10, 99)}.md" for w in rng.sample(HOP_WORDS, 2 * difficulty + 1)]
    chain, decoys = names[:difficulty], names[difficulty:]
    key, *decoy_keys = (f"{what.split()[0]}/{n}" for n in rng.sample(range(100, 1000), 3))  # no tell in the name
    codes = rng.sample(range(1000, 9999), 3)

    def note(title: str, lines: list[str]) -> str:
        rng.shuffle(lines)  # the owner's line is not always first
        return f"# {title}\n\n{rng.choice(HOP_FILLER)}\n" + "".join(f"- {line}\n" for line in lines)

    files: dict[str, str | bytes] = {}
    for i, path in enumerate(chain):
        if i + 1 < len(chain):
            lines = [f"For {owner}: see {chain[i + 1]}."]
        else:
            lines = [f"For {owner}: the {what} is stored under the key `{key}`."]
        # each rival's line leads to a decoy file at every hop but the last, where it names a decoy key
        lines += [f"For {r}: see {decoys[i * 2 + j]}." if i + 1 < len(chain)
                  else f"For {r}: the {what} is stored under the key `{decoy_keys[j]}`." for j, r in enumerate(rivals)]
        files[path] = note(path.split("/")[1][:-3].replace("_", " ").title(), lines)
    for j, path in enumerate(decoys[:2 * (difficulty - 1)]):  # the files the rivals' lines point to
        files[path] = note("Archive", [f"For {rivals[j % 2]}: the {what} is stored under the key "
                                       f"`{decoy_keys[j % 2]}`."])
    files[KV_PATH] = kv_file({key: codes[0], decoy_keys[0]: codes[1], decoy_keys[1]: codes[2]})
    instruction = (f"Find the {what} of {owner}. Start at {chain[0]} and follow the references for {owner}; the last "
                   f"one names a key of the key-value store that holds the {what}. Submit the {what} (a number).")
    solution = [Call("ReadFile", {"path": p}) for p in chain] + [Call("KVGet", {"key": key}),
                                                                 Call("Submit", {"answer": str(codes[0])})]
    return {"instruction": instruction, "files": files,
            "grader_files": {"grade.py": HOP_GRADE, "expected.json": json.dumps({"answer": codes[0]}) + "\n"},
            "tools": ["ReadFile", "Glob", "Grep", "KVGet", "KVList", "Submit"], "solution": solution}


def _hop_wrong(task: Task) -> list[Call]:
    """A number one off the owner's code: scores 0."""
    return [Call("Submit", {"answer": str(json.loads(task.grader_files["expected.json"])["answer"] + 1)})]


MULTI_HOP = register(Family(name="multi_hop", templates=("supplier", "door"), heldout_templates=("incident",),
                            build=_hop_build, wrong=_hop_wrong,
                            description="follow references across notes files to a key-value store entry"))

"""Task families for agentic RL (openk3/agent/tasks): determinism, disjoint splits, graders that can be
trusted (independent recomputation, the reference solution scores 1, wrong and no-op ones 0, tampering with
what the agent controls never raises the reward)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
import tempfile

import pytest

from openk3.agent import Sandbox, unavailable_reason
from openk3.agent.sandbox import RunResult
from openk3.agent.tasks import (
    FAMILIES,
    SPLITS,
    Call,
    base,
    data_wrangle,
    families,
    fix_test,
    generate,
    parse_grade,
    run_calls,
    split_of,
    tool_arith,
)
from openk3.agent.tasks.base import _canonical_bytes, write_tree

ALL = ("data_wrangle", "fix_test", "tool_arith")


def needs_sandbox():
    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"no sandbox on this host: {why}")


def _sandbox(task, **kw):
    return Sandbox(files=task.files, env=task.env, **kw)


# ---- generation ----------------------------------------------------------------------------------------


def test_registry_lists_the_three_families():
    assert set(ALL) <= set(families())
    for name in ALL:
        fam = FAMILIES[name]
        assert not set(fam.templates) & set(fam.heldout_templates)


@pytest.mark.parametrize("family", ALL)
def test_generate_is_deterministic(family):
    for split in SPLITS:
        for difficulty in (1, 2, 3):
            for seed in (0, 1, 17):
                a = generate(family, seed, difficulty, split)
                base._MADE.clear()  # built again, not the kept copy
                b = generate(family, seed, difficulty, split)
                assert a == b and a.solution == b.solution and a.grader_key == b.grader_key
    assert generate(family, 0, 2) != generate(family, 1, 2)


def test_generate_hands_out_copies_of_the_task_it_made_once(monkeypatch):
    """`generate` keeps what it built (an evaluation draws the same tasks for every model it scores); each call
    gets its own copy, and a family replaced under the same name is built afresh."""
    a = generate("fix_test", 3, 1, "test")
    a.files["notes.txt"] = "changed"
    a.tools.append("Nope")
    a.grader_files.clear()
    b = generate("fix_test", 3, 1, "test")
    assert "notes.txt" not in b.files and "Nope" not in b.tools and b.grader_files
    assert b is not generate("fix_test", 3, 1, "test") and b == generate("fix_test", 3, 1, "test")
    fam = FAMILIES["fix_test"]
    monkeypatch.setitem(FAMILIES, "fix_test", dataclasses.replace(
        fam, build=lambda rng, d, t: {**fam.build(rng, d, t), "instruction": "other"}))
    assert generate("fix_test", 3, 1, "test").instruction == "other"


def test_generate_does_not_depend_on_the_hash_seed():
    # str hashing is randomised per process: a task drawn from set or dict-of-str order would change.
    code = ("from openk3.agent.tasks import generate; print([generate(f, s, d, sp).content_hash() "
            "for f in ('fix_test', 'data_wrangle', 'tool_arith') for s in (0, 5) for d in (1, 3) "
            "for sp in ('train', 'heldout')])")
    outs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(h)},
                           capture_output=True, text=True, check=True).stdout for h in (1, 2)}
    assert len(outs) == 1


@pytest.mark.parametrize("family", ALL)
def test_splits_do_not_overlap(family):
    fam = FAMILIES[family]
    seen: dict[str, set] = {s: set() for s in SPLITS}
    templates: dict[str, set] = {s: set() for s in SPLITS}
    for split in SPLITS:
        for difficulty in (1, 2, 3):
            for seed in range(12):
                t = generate(family, seed, difficulty, split)
                assert (t.family, t.seed, t.difficulty, t.split) == (family, seed, difficulty, split)
                seen[split].add(t.content_hash())
                templates[split].add(t.template)
                if split != "heldout":
                    assert split_of(t) == split
    assert not seen["train"] & seen["test"]
    assert not (seen["train"] | seen["test"]) & seen["heldout"]
    assert templates["heldout"] <= set(fam.heldout_templates)
    assert (templates["train"] | templates["test"]) <= set(fam.templates)
    assert len(seen["test"]) > 30  # distinct instances, not one task repeated


def test_heldout_functions_never_appear_in_train_or_test():
    for split in ("train", "test"):
        for difficulty in (1, 2, 3):
            for seed in range(10):
                text = "".join(generate("fix_test", seed, difficulty, split).files.values())
                assert not any(f"def {fn}(" in text for fn in fix_test.HELDOUT)


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown task family 'nope'"):
        generate("nope", 0)
    with pytest.raises(ValueError, match="seed"):
        generate("tool_arith", -1)
    with pytest.raises(ValueError, match="difficulty"):
        generate("tool_arith", 0, difficulty=4)
    with pytest.raises(ValueError, match="split"):
        generate("tool_arith", 0, split="dev")


def test_task_files_are_small():
    for family in ALL:
        t = generate(family, 3, 3)
        assert sum(len(v) for v in t.files.values()) < 32 << 10
        assert t.instruction and t.tools and t.solution and "grade.py" in t.grader_files


def test_content_hash_reads_sqlite_files_by_their_dump():
    # The split must not depend on the SQLite library's byte layout: the same rows give the same hash.
    t = generate("data_wrangle", 0, 2)
    raw = t.files[data_wrangle.DB_PATH]
    assert _canonical_bytes(raw).startswith(b"BEGIN TRANSACTION;")
    assert b"CREATE TABLE products" in _canonical_bytes(raw)


def test_grader_dir_is_world_readable_and_removed():
    t = generate("fix_test", 0, 3)
    with t.grader_dir() as d:
        for root, _dirs, names in os.walk(d):
            assert stat.S_IMODE(os.stat(root).st_mode) == 0o755
            for n in names:
                assert stat.S_IMODE(os.stat(os.path.join(root, n)).st_mode) == 0o644
        assert sorted(os.listdir(d)) == sorted(t.grader_files)
    assert not os.path.exists(d)


def test_parse_grade_needs_nonce_exit_zero_and_range():
    def rr(out, code=0, **kw):
        return RunResult(code, out, "", kw.get("timed_out", False), 0.0, False, kw.get("error"))

    good = json.dumps({"nonce": "n1", "reward": 0.5})
    assert parse_grade(rr("noise\n" + good + "\n"), "n1") == 0.5
    assert parse_grade(rr(good + "\nafter"), "n1") == 0.0  # the reply must be the last line
    assert parse_grade(rr(good), "n2") == 0.0
    assert parse_grade(rr(good, code=1), "n1") == 0.0
    assert parse_grade(rr(good, timed_out=True), "n1") == 0.0
    assert parse_grade(rr(good, error="agent died"), "n1") == 0.0
    assert parse_grade(rr(json.dumps({"nonce": "n1", "reward": 1.5})), "n1") == 0.0
    assert parse_grade(rr(json.dumps({"nonce": "n1", "reward": True})), "n1") == 0.0


# ---- independent checks of the expected answers ----------------------------------------------------------


def test_fix_test_bugs_are_unique_and_change_behaviour():
    import random

    for fn in fix_test.FUNCTIONS.values():
        for correct, bad in fn.bugs:
            assert fn.source.count(correct) == 1, (fn.name, correct)
            buggy = fn.source.replace(correct, bad)
            args = [a for seed in range(3) for a in fn.inputs(random.Random(seed))]
            run = fix_test.run_function
            assert any(run(fn.source, fn.name, a) != run(buggy, fn.name, a) for a in args)


def test_fix_test_visible_tests_fail_then_pass_with_the_fix():
    # Run on the host (plain files, the host's python): the seeded bugs make the visible tests fail and the
    # reference edits make them pass.
    for split, difficulty in (("train", 1), ("test", 2), ("heldout", 3)):
        t = generate("fix_test", 4, difficulty, split)
        with tempfile.TemporaryDirectory() as d:
            write_tree(d, t.files)
            cmd = [sys.executable, "-B", "-m", "unittest", "discover", "-s", "tests", "-t", "."]
            assert subprocess.run(cmd, cwd=d, capture_output=True).returncode != 0
            for call in t.solution:
                if call.name == "StrReplaceFile":
                    path = os.path.join(d, call.args["path"])
                    src = open(path).read()
                    assert src.count(call.args["edit"]["old"]) == 1
                    open(path, "w").write(src.replace(call.args["edit"]["old"], call.args["edit"]["new"]))
            r = subprocess.run(cmd, cwd=d, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr


def _sql_expected(task) -> dict:
    """data_wrangle's expected rows recomputed with SQL (independent of the family's Python aggregate)."""
    spec = json.loads(task.grader_files["spec.json"])
    conn = sqlite3.connect(":memory:")
    with tempfile.NamedTemporaryFile(suffix=".db", delete=False) as f:
        f.write(task.files[data_wrangle.DB_PATH])
    conn.execute(f"ATTACH '{f.name}' AS app")
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(task.files["data/orders.csv"])))
    cols = list(rows[0])
    conn.execute(f"CREATE TABLE orders ({', '.join(cols)})")
    conn.executemany(f"INSERT INTO orders VALUES ({', '.join('?' * len(cols))})", [list(r.values()) for r in rows])
    conn.execute("CREATE TABLE customers (id, name, region)")
    customers = json.loads(task.files["data/customers.json"])
    conn.executemany("INSERT INTO customers VALUES (:id, :name, :region)", customers)
    group = spec["group"]
    if spec["difficulty"] == 1:
        key = f"o.{group}"
    else:
        key = "c.region" if group == "region" else "p.category"
    agg = {"revenue": "SUM(o.qty * o.unit_price)", "units": "SUM(o.qty)",
           "mean_order": "AVG(o.qty * o.unit_price)", "max_order": "MAX(o.qty * o.unit_price)"}[spec["measure"]]
    where = "WHERE o.order_id NOT IN (SELECT order_id FROM app.returns)" if spec["difficulty"] == 3 else ""
    q = (f"SELECT {key}, {agg} FROM orders o JOIN customers c ON c.id = o.customer_id "
         f"JOIN app.products p ON p.name = o.product {where} GROUP BY 1")
    out = {k: round(float(v), 2) for k, v in conn.execute(q)}
    conn.close()
    os.unlink(f.name)
    return out


def test_data_wrangle_aggregate_matches_sql():
    ns: dict = {}
    exec(data_wrangle.AGGREGATE, ns)
    for split in SPLITS:
        for difficulty in (1, 2, 3):
            for seed in range(3):
                t = generate("data_wrangle", seed, difficulty, split)
                spec = json.loads(t.grader_files["spec.json"])
                with t.grader_dir() as d:
                    got = ns["aggregate"](f"{d}/data", f"{d}/app.db", spec["measure"], spec["group"], difficulty)
                want = _sql_expected(t)
                assert got.keys() == want.keys()
                assert all(abs(got[k] - want[k]) < 0.011 for k in want), (t.id, got, want)


def _kv_entries(task) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".db") as f:
        f.write(task.files[tool_arith.KV_PATH])
        f.flush()
        conn = sqlite3.connect(f.name)
        rows = dict(conn.execute("SELECT key, value FROM kv WHERE deleted = 0"))
        conn.close()
    return {k: json.loads(v) for k, v in rows.items()}


def test_tool_arith_expected_matches_the_store():
    # Recompute each answer from the KV file and the instruction text, not from the generator's bookkeeping.
    for split in SPLITS:
        for difficulty in (1, 2, 3):
            for seed in range(4):
                t = generate("tool_arith", seed, difficulty, split)
                kv = _kv_entries(t)
                expected = json.loads(t.grader_files["expected.json"])["result"]
                if t.template == "expression":
                    formula = re.search(r"Compute (.+?), where", t.instruction).group(1)
                    names = re.findall(r"[a-z]+_\d+", formula)
                    want = eval(formula, {}, {n: kv[n] for n in names})  # noqa: S307 - our own formula text
                elif t.template == "ledger":
                    account = re.search(r"account '(\w+)'", t.instruction).group(1)
                    mine = [v for k, v in kv.items() if k.startswith(f"ledger/{account}/")]
                    want = sum(v["amount"] for v in mine if not v["void"])
                elif t.template == "chain":
                    want, k = 0, "start"
                    while k is not None:
                        want, k = want + kv[k]["value"], kv[k]["next"]
                else:
                    want = sum(v["qty"] * v["price"] for k, v in kv.items() if not v["discontinued"])
                assert expected == want, t.id


# ---- graded in a real sandbox ---------------------------------------------------------------------------

CASES = [(0, 1, "train"), (1, 3, "test"), (2, 2, "heldout")]


@pytest.mark.parametrize("family", ALL)
def test_reference_scores_one_wrong_and_noop_zero(family):
    needs_sandbox()
    for seed, difficulty, split in CASES:
        t = generate(family, seed, difficulty, split)
        with _sandbox(t) as sb:
            start = sb.snapshot()
            assert sb.run("ls /grader").exit_code != 0  # the episode never sees the grader
            assert t.score(sb, None) == 0.0, t.id
            answer = run_calls(sb, FAMILIES[family].wrong(t), t.sql_mode)
            assert t.score(sb, answer) == 0.0, t.id
            sb.restore(start)
            answer = run_calls(sb, t.solution, t.sql_mode)
            assert t.score(sb, answer) == 1.0, t.id
            assert t.score(sb, answer) == 1.0  # scoring leaves the episode's sandbox as it was


def test_verify_ignores_the_agents_shell_environment():
    # BASH_ENV runs before every command of the shell that carries it: unless verify resets the fork's
    # environment, this script reads the nonce off the grader command line and forges a full reward.
    needs_sandbox()
    t = generate("tool_arith", 0, 1)
    forge = ('n=$(printf %s "$1" | sed -n "s/.*OPENK3_NONCE=\\([0-9a-f]*\\).*/\\1/p"); '
             '[ -n "$n" ] && printf \'{"nonce": "%s", "reward": 1.0}\\n\' "$n" && exit 0\n')
    with _sandbox(t) as sb:
        sb.tool("WriteFile", {"path": "forge.sh", "content": forge})
        sb.run("export BASH_ENV=/workspace/forge.sh")
        assert "BASH_ENV" in sb.env
        assert t.score(sb, "0") == 0.0


def _apply_fixes(sb, task):
    for call in task.solution:
        if call.name == "StrReplaceFile":
            assert sb.tool(call.name, call.args)["ok"]


def test_fix_test_agent_code_cannot_read_the_graders_environment():
    # The fixed module keeps its right answers only if it could read the grader's environ (where the HMAC key
    # is: with it, expected values can be brute-forced from /grader/cases.json). The grader is undumpable, so
    # it cannot, and the reward is 0; the control (same module, no condition) proves the module works.
    needs_sandbox()
    t = generate("fix_test", 0, 1)
    module = next(p for p in t.files if not p.startswith("tests/"))
    probe = ("\nimport os as _os\ntry:\n    open('/proc/%d/environ' % _os.getppid(), 'rb').read()\n"
             "    _LEAK = True\nexcept OSError:\n    _LEAK = False\n")
    breaker = ("if not _LEAK:\n    for _n in [n for n, f in list(globals().items()) if callable(f) "
               "and not n.startswith('_')]:\n        globals()[_n] = lambda *a: None\n")
    with _sandbox(t) as sb:
        _apply_fixes(sb, t)
        start = sb.snapshot()
        sb.tool("WriteFile", {"path": module, "content": probe, "mode": "append"})
        assert t.score(sb, "fixed") == 1.0  # control: the probe alone changes nothing
        sb.tool("WriteFile", {"path": module, "content": breaker, "mode": "append"})
        assert t.score(sb, "fixed") == 0.0
        sb.restore(start)


def test_fix_test_grader_ignores_bytecode_left_in_the_workspace():
    # A .pyc compiled from the fixed source, stamped with the buggy file's mtime and size, makes Python run the
    # fix while the source keeps the bug. The visible tests pass on it; the grader must still score 0.
    needs_sandbox()
    t = generate("fix_test", 1, 1)
    fix = next(c for c in t.solution if c.name == "StrReplaceFile")
    path = fix.args["path"]
    fixed_src = t.files[path].replace(fix.args["edit"]["old"], fix.args["edit"]["new"])
    forge = ("import importlib.util, importlib._bootstrap_external as be, os\n"
             f"p = os.path.abspath({path!r}); st = os.stat(p)\n"
             "code = compile(open('fixed.txt').read(), p, 'exec')\n"
             "out = importlib.util.cache_from_source(p); os.makedirs(os.path.dirname(out), exist_ok=True)\n"
             "open(out, 'wb').write(be._code_to_timestamp_pyc(code, st.st_mtime, st.st_size))\n")
    with _sandbox(t) as sb:
        sb.tool("WriteFile", {"path": "fixed.txt", "content": fixed_src})
        sb.tool("WriteFile", {"path": "forge.py", "content": forge})
        assert sb.run("python3 forge.py").exit_code == 0
        assert sb.run("python3 -m unittest discover -s tests -t .").exit_code == 0  # the forgery works
        assert t.score(sb, "fixed") == 0.0


def test_data_wrangle_grader_uses_pristine_inputs():
    # Empty the workspace's orders, then run the reference script: its (empty) report matches the tampered
    # data, and would score 1 if the grader recomputed from the workspace.
    needs_sandbox()
    t = generate("data_wrangle", 0, 1)
    with _sandbox(t) as sb:
        assert sb.run("head -n 1 data/orders.csv > o && mv o data/orders.csv").exit_code == 0
        answer = run_calls(sb, t.solution, t.sql_mode)
        assert t.score(sb, answer) == 0.0


def test_tool_arith_half_credit_for_store_or_answer():
    needs_sandbox()
    t = generate("tool_arith", 2, 2)
    result = next(c.args["value"] for c in t.solution if c.name == "KVSet")
    with _sandbox(t) as sb:
        run_calls(sb, [Call("KVSet", {"key": "result", "value": result})])
        assert t.score(sb, str(result + 1)) == 0.5
        assert t.score(sb, f" {result} ") == 1.0
        run_calls(sb, [Call("KVSet", {"key": "result", "value": str(result)})])  # a string, not a number
        assert t.score(sb, str(result)) == 0.5


def test_bench_sandbox_runs(tmp_path):
    # The benchmark end to end at 1 rep (no timed asserts): a change that breaks it fails here. Its episode
    # row asserts that the scripted episode scores 1.0 in a real sandbox.
    needs_sandbox()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_sandbox

    out = bench_sandbox.main(["--reps", "1", "--json", str(tmp_path / "r.json")])
    ops = [r["op"] for r in out["rows"]]
    assert {"start + first run", "run (warm)", "snapshot", "restore", "fork n=1", "fork n=8", "close"} <= set(ops)
    assert ops[-1].startswith("episode") and json.loads((tmp_path / "r.json").read_text())["rows"]
    assert len(bench_sandbox.episode_calls(generate("tool_arith", 0, 3))) == 10


def test_data_wrangle_table_written_with_the_sql_tool_scores_one():
    # The SQL tool's database is the one the grader reads: rows inserted through the tool (values recomputed
    # here with SQL) score 1; a missing group scores 0.
    needs_sandbox()
    t = next(t for s in range(40) if (t := generate("data_wrangle", s, 2)).template == "units_category_table")
    spec = json.loads(t.grader_files["spec.json"])
    group, column = spec["columns"]
    rows = sorted(_sql_expected(t).items())
    with _sandbox(t) as sb:
        ok = sb.tool("SQL", {"query": f"CREATE TABLE {spec['table']} ({group} TEXT, {column} REAL)"},
                     sql_mode=t.sql_mode)
        assert ok["ok"], ok
        start = sb.snapshot()
        for k, v in rows[:-1]:
            assert sb.tool("SQL", {"query": f"INSERT INTO {spec['table']} VALUES (?, ?)", "params": [k, v]},
                           sql_mode=t.sql_mode)["ok"]
        assert t.score(sb, "done") == 0.0
        sb.restore(start)
        for k, v in rows:
            sb.tool("SQL", {"query": f"INSERT INTO {spec['table']} VALUES (?, ?)", "params": [k, v]},
                    sql_mode=t.sql_mode)
        assert t.score(sb, "done") == 1.0

"""data_wrangle: aggregate orders from CSV, JSON and SQLite into a report file or a SQL table.

The workspace holds `data/orders.csv` (order_id, customer_id, product, qty, unit_price, and at difficulty 1 the
grouping column itself), `data/customers.json` (id, name, region) and the SQL tool's database
`.state/app.db` (tables `products(name, category)` and, at difficulty 3, `returns(order_id)`). The task asks
for one aggregate per group, written to a CSV file or to a table of app.db.

Difficulty: 1 = the group is a column of orders.csv; 2 = the group comes from a join (customers.json for the
region, the products table for the category); 3 = the join, and returned orders (the returns table) are left
out. Templates (train/test): revenue by region to a CSV file, units by category to a table, revenue by
category to a CSV file. Held out: mean order value by region to a table, largest order by category to a CSV
file.

The grader recomputes the expected rows from pristine copies of the inputs in /grader (so editing or
deleting the workspace's inputs changes nothing) and compares the agent's output: reward 1.0 when the groups
match exactly and every value is within 0.01, else 0.0.
"""

from __future__ import annotations

import csv
import io
import json
import random

from ..toolbox_apps import SQL_FILE, STATE_DIR
from .base import GRADER_PRELUDE, Call, Family, Task, register, sqlite_bytes

TOOLS = ["Shell", "ReadFile", "WriteFile", "Glob", "Grep", "SQL", "Submit"]
DB_PATH = f"{STATE_DIR}/{SQL_FILE}"
REGIONS = ("north", "south", "east", "west", "central")
CATEGORIES = ("tools", "garden", "kitchen", "office", "toys")
PRODUCTS = ("hammer", "rake", "kettle", "stapler", "kite", "drill", "hose", "whisk", "binder", "yoyo", "saw",
            "shovel", "pan", "lamp", "puzzle", "wrench", "trowel", "ladle", "marker", "robot")
FIRST = ("ada", "ben", "cy", "dee", "eli", "fay", "gus", "hal", "ivy", "jo", "kai", "lu", "max", "ned", "oli")
ROWS = {1: 16, 2: 30, 3: 45}

# template -> (measure, group, output)
TEMPLATES = {
    "revenue_region_file": ("revenue", "region", "file"),
    "units_category_table": ("units", "category", "table"),
    "revenue_category_file": ("revenue", "category", "file"),
    "mean_order_region_table": ("mean_order", "region", "table"),  # held out
    "max_order_category_file": ("max_order", "category", "file"),  # held out
}
HELDOUT = ("mean_order_region_table", "max_order_category_file")
MEASURES = {  # name -> (column name, what the instruction says)
    "revenue": ("revenue", "the total revenue (sum of qty * unit_price)"),
    "units": ("units", "the total number of units sold (sum of qty)"),
    "mean_order": ("mean_order", "the mean order value (mean over orders of qty * unit_price)"),
    "max_order": ("max_order", "the largest order value (max over orders of qty * unit_price)"),
}

# The aggregation, shared by the grader (from /grader's pristine copies) and the reference solution (from the
# workspace): the same text, run under the sandbox's python3.
AGGREGATE = '''\
import csv, json, sqlite3


def aggregate(data_dir, db_path, measure, group, difficulty):
    with open(data_dir + "/orders.csv", newline="") as f:
        orders = list(csv.DictReader(f))
    with open(data_dir + "/customers.json") as f:
        region_of = {c["id"]: c["region"] for c in json.load(f)}
    conn = sqlite3.connect("file:" + db_path + "?mode=ro", uri=True)
    try:
        category_of = dict(conn.execute("SELECT name, category FROM products"))
        returned = {r[0] for r in conn.execute("SELECT order_id FROM returns")} if difficulty == 3 else set()
    finally:
        conn.close()
    values = {}
    for o in orders:
        if int(o["order_id"]) in returned:
            continue
        if difficulty == 1:
            key = o[group]
        else:
            key = region_of[o["customer_id"]] if group == "region" else category_of[o["product"]]
        qty, value = int(o["qty"]), int(o["qty"]) * float(o["unit_price"])
        values.setdefault(key, []).append(qty if measure == "units" else value)
    reduce = {"revenue": sum, "units": sum, "mean_order": lambda v: sum(v) / len(v), "max_order": max}[measure]
    return {k: round(reduce(v), 2) for k, v in sorted(values.items())}
'''

GRADE = GRADER_PRELUDE + AGGREGATE + '''\
import math

with open("/grader/spec.json") as f:
    spec = json.load(f)
expected = aggregate("/grader/data", "/grader/app.db", spec["measure"], spec["group"], spec["difficulty"])
got = {}
try:
    if spec["output"] == "file":
        with open(WORKSPACE + "/" + spec["path"], newline="") as f:
            rows = list(csv.reader(f))
        if [c.strip() for c in rows[0]] != spec["columns"]:
            finish(0.0, error="header")
        body = [r for r in rows[1:] if r]
    else:
        conn = sqlite3.connect("file:" + WORKSPACE + "/.state/app.db?mode=ro", uri=True)
        try:
            body = conn.execute('SELECT "%s", "%s" FROM "%s"' % (*spec["columns"], spec["table"])).fetchall()
        finally:
            conn.close()
    for key, value in body:
        v = parse_number(value)
        if str(key) in got or v is None:
            finish(0.0, error="duplicate group or non-number")
        got[str(key)] = v
except Exception as e:
    finish(0.0, error=type(e).__name__)
ok = got.keys() == expected.keys() and all(math.isclose(got[k], expected[k], abs_tol=0.0101) for k in expected)
finish(1.0 if ok else 0.0, groups=len(expected))
'''


def _data(rng: random.Random, difficulty: int, group: str):
    n = ROWS[difficulty]
    products = rng.sample(PRODUCTS, 8 + difficulty)
    categories = {p: rng.choice(CATEGORIES) for p in products}
    customers = [{"id": f"c{rng.randint(100, 999)}{i}", "name": f"{rng.choice(FIRST)} {rng.choice(FIRST)}son",
                  "region": rng.choice(REGIONS)} for i in range(5 + difficulty)]
    region_of = {c["id"]: c["region"] for c in customers}
    ids = rng.sample(range(1000, 9999), n)
    orders = []
    for oid in ids:
        c, p = rng.choice(customers), rng.choice(products)
        orders.append({"order_id": oid, "customer_id": c["id"], "product": p, "qty": rng.randint(1, 12),
                       "unit_price": f"{rng.randint(100, 9999) / 100:.2f}"})
    cols = ["order_id", "customer_id", "product", "qty", "unit_price"]
    if difficulty == 1:  # the group is a column: no join needed
        cols.append(group)
        for o in orders:
            o[group] = region_of[o["customer_id"]] if group == "region" else categories[o["product"]]
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(orders)
    returns = rng.sample(ids, max(2, n // 8)) if difficulty == 3 else []

    def fill(conn):
        conn.execute("CREATE TABLE products (name TEXT PRIMARY KEY, category TEXT NOT NULL)")
        conn.executemany("INSERT INTO products VALUES (?, ?)", sorted(categories.items()))
        if difficulty == 3:
            conn.execute("CREATE TABLE returns (order_id INTEGER PRIMARY KEY, reason TEXT)")
            conn.executemany("INSERT INTO returns VALUES (?, ?)",
                             [(r, rng.choice(("damaged", "late", "wrong item"))) for r in sorted(returns)])

    return {"data/orders.csv": out.getvalue(), "data/customers.json": json.dumps(customers, indent=1) + "\n",
            DB_PATH: sqlite_bytes(fill)}


def build(rng: random.Random, difficulty: int, template: str) -> dict:
    measure, group, output = TEMPLATES[template]
    files = _data(rng, difficulty, group)
    column, what = MEASURES[measure]
    columns = [group, column]
    name = rng.choice(("summary", "report", "totals", "by_" + group))
    if difficulty == 1:
        source = f"each order's `{group}` column"
    elif group == "region":
        source = "the customer's region (data/customers.json)"
    else:
        source = f"the product's category (the `products` table of {DB_PATH}, the SQL tool's database)"
    extra = (" Leave out returned orders (the order ids in the `returns` table of the database)."
             if difficulty == 3 else "")
    if output == "file":
        path = f"out/{name}.csv"
        target = (f"Write the result to {path} as CSV with the header `{group},{column}` and one row per {group}, "
                  f"sorted by {group}, values rounded to 2 decimals.")
        spec_out = {"path": path}
    else:
        target = (f"Store the result in a new table `{name}` ({group} TEXT, {column} REAL) of the database "
                  f"{DB_PATH} (use the SQL tool), one row per {group}, values rounded to 2 decimals.")
        spec_out = {"table": name}
    instruction = (f"The folder data/ holds orders (orders.csv) and customers (customers.json); {DB_PATH} is a "
                   f"SQLite database. For each {group}, compute {what}, taking the {group} from {source}.{extra} "
                   f"{target} Then call Submit with a one-line summary.")
    spec = {"measure": measure, "group": group, "output": output, "difficulty": difficulty, "columns": columns,
            **spec_out}
    grader_files = {"grade.py": GRADE, "spec.json": json.dumps(spec) + "\n", "app.db": files[DB_PATH],
                    "data/orders.csv": files["data/orders.csv"], "data/customers.json": files["data/customers.json"]}
    return {"instruction": instruction, "files": files, "grader_files": grader_files, "tools": list(TOOLS),
            "solution": _script_solution(spec, 0)}


def _script_solution(spec: dict, offset: float) -> list[Call]:
    """A script that computes the aggregate from the workspace's files and writes it where the spec says
    (`offset` is added to every value: the wrong solution)."""
    if spec["output"] == "file":
        write = (f"import os\nos.makedirs('out', exist_ok=True)\n"
                 f"with open({spec['path']!r}, 'w', newline='') as f:\n"
                 f"    w = csv.writer(f)\n    w.writerow({spec['columns']!r})\n"
                 f"    w.writerows([k, f'{{v:.2f}}'] for k, v in result.items())\n")
    else:
        g, c = spec["columns"]
        write = (f"conn = sqlite3.connect({DB_PATH!r})\n"
                 f"conn.execute('CREATE TABLE {spec['table']} ({g} TEXT, {c} REAL)')\n"
                 f"conn.executemany('INSERT INTO {spec['table']} VALUES (?, ?)', result.items())\n"
                 f"conn.commit()\nconn.close()\n")
    script = (AGGREGATE + f"\nresult = aggregate('data', {DB_PATH!r}, {spec['measure']!r}, {spec['group']!r}, "
              f"{spec['difficulty']})\nresult = {{k: round(v + {offset}, 2) for k, v in result.items()}}\n"
              + write + "print(len(result))\n")
    return [Call("WriteFile", {"path": "solve.py", "content": script}),
            Call("Shell", {"command": "python3 solve.py"}),
            Call("Submit", {"answer": "done"})]


def _spec(task: Task) -> dict:
    return json.loads(task.grader_files["spec.json"])


def wrong(task: Task) -> list[Call]:
    """The right groups, every value off by 1: scores 0."""
    return _script_solution(_spec(task), 1.0)


FAMILY = register(Family(name="data_wrangle", templates=tuple(t for t in TEMPLATES if t not in HELDOUT),
                         heldout_templates=HELDOUT, build=build, wrong=wrong,
                         description="aggregate CSV/JSON/SQLite data into a report file or a SQL table"))

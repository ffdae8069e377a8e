"""Renders bench/results/services-scale.json (one `make bench` run) as a PNG: each timed
operation against its goal and against the figure before the scale work, on a log scale."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src, out = sys.argv[1], sys.argv[2]
doc = json.load(open(src))
rows = [r for r in doc["results"] if r["unit"] == "ms"]
names = [r["name"] for r in rows]
y = range(len(rows))
fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.8))
h = 0.21
ax.barh([i + 1.5 * h for i in y], [r["value"] for r in rows], height=h, label="measured (wall)", color="#2b7bba")
ax.barh([i + 0.5 * h for i in y], [r.get("cpu_ms") or 0 for r in rows], height=h, label="CPU time (user + sys)", color="#9ecae1")
ax.barh([i - 0.5 * h for i in y], [r["goal"]["max"] if r["goal"] else 0 for r in rows], height=h, label="goal (max)", color="#8fd18f")
ax.barh([i - 1.5 * h for i in y], [r["before"] or 0 for r in rows], height=h, label="before the scale work", color="#e08a7a")
for i, r in zip(y, rows):
    ax.text(r["value"] * 1.1, i + 1.5 * h, f'{r["value"]:.1f} ms', va="center", fontsize=7)
ax.set_yticks(list(y))
ax.set_yticklabels(names, fontsize=8)
ax.set_xscale("log")
ax.set_xlabel("milliseconds (log scale; shorter is better)")
ax.invert_yaxis()
m = doc["machine"]
ax.set_title(
    f'Service layer at scale: {doc["services"]:,} Services ({doc["ports"]:,} ports), {doc["pods"]} pods\n'
    f'{doc["date"]}, {m["cpus"]} CPUs (load {m.get("loadavg", "?").split(" ")[0]}), kernel {m["kernel"]}, aether-cni {m["aether_cni"]}',
    fontsize=9,
)
ax.legend(loc="upper right", fontsize=8)
fig.tight_layout()
fig.savefig(out, dpi=110)

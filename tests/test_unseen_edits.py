"""The unseen_edits workload (scripts/make_workloads.py) and its runner bench/many_steps.py:
editing sessions of edit kinds and wordings neither iterate's generator nor the calibration
has, every prompt read back to exactly its scene and every scene judged right by the checker
on its own render. Fast: MiniLM's tokenizer and the world's renderer, no diffusion model."""
import collections
import json
import random

import pytest
import repo_scripts

from test_tinyworld_language import assert_describes
from tinyworld import checker as CH
from tinyworld import language as LANG
from tinyworld import world as WD

REPO = repo_scripts.REPO


def _make_workloads():
    return repo_scripts.load("scripts/make_workloads.py", "make_workloads")


@pytest.fixture(scope="module")
def generated():
    return _make_workloads().unseen_edit_phrasings()


def test_unseen_edits_are_deterministic_and_committed(generated):
    lines = [line for line, _ in generated]
    assert len(lines) >= 150
    assert _make_workloads().unseen_edits() == lines
    committed = (REPO / "bench" / "workloads" / "unseen_edits.jsonl").read_text().splitlines()
    assert committed == [json.dumps(line) for line in lines]


def test_unseen_edits_hold_every_edit_kind(generated):
    lines = [line for line, _ in generated]
    kinds = collections.Counter(line["edit"] for line in lines)
    for kind in ("flip_reword_position", "flip_reword_motion", "colour_swap", "add_object",
                 "remove_object", "new_template"):
        assert kinds[kind] >= 15, kinds
    assert sum(len(line["scene"]["objects"]) == 2 for line in lines) >= len(lines) / 2
    sessions = collections.defaultdict(list)
    for line in lines:
        sessions[line["session"]].append(line)
    for sess in sessions.values():  # one seed a session; each edit changes what it says it does
        assert len({line["seed"] for line in sess}) == 1 and sess[0]["edit"] == "start"
        for before, after in zip(sess, sess[1:]):
            a, b = before["scene"]["objects"], after["scene"]["objects"]
            if after["edit"] == "new_template":
                assert a == b and before["prompt"] != after["prompt"]
            elif after["edit"] == "colour_swap":
                assert [o["colour"] for o in a] == [o["colour"] for o in b][::-1]
            elif after["edit"] in ("add_object", "remove_object"):
                assert len(b) == len(a) + (1 if after["edit"] == "add_object" else -1)
            else:  # a flip: one object's position or motion to its opposite on one axis
                attr = after["edit"].rsplit("_", 1)[1]
                changed = [(x, y) for x, y in zip(a, b) if x != y]
                assert len(changed) == 1 and {k for k in WD.ATTRIBUTES if changed[0][0][k] != changed[0][1][k]} == {attr}


def test_unseen_edit_wording_is_no_other_workload_s(generated):
    """Training families of the broad language (no other workload draws from them), the new
    template edit in revision 2's own clauses; none of it caption()'s grammar."""
    train = set(LANG.TRAIN_FAMILIES)
    for line, said in generated:
        used = set(said.families["clause"]) | {said.families[k] for k in ("joiner", "frame", "surface")
                                               if said.families[k]}
        assert used <= train, (line["prompt"], used)
        if line["edit"] == "new_template":
            assert set(said.families["clause"]) <= {"clause.located", "clause.appears"}
    others = [json.loads(x) for p in (REPO / "bench" / "workloads").glob("*.jsonl") if p.stem != "unseen_edits"
              for x in p.read_text().splitlines()]
    ours = [line for line, _ in generated]
    assert not {x["prompt"] for x in ours} & {x["prompt"] for x in others}
    assert not {x["seed"] for x in ours} & {x["seed"] for x in others}


def test_every_unseen_edit_prompt_reads_as_its_scene_and_renders_right(generated):
    """Each prompt is its phrasing's text, whose pieces the language test's own keyword reader
    reads back to exactly the line's scene; world.parse_caption (caption()'s grammar only)
    refuses it or agrees; the checker judges the scene's render right on every attribute."""
    for line, said in generated:
        assert said.text == line["prompt"]
        assert_describes(said, line["scene"])
        try:
            parsed = WD.parse_caption(line["prompt"])
        except ValueError:
            parsed = None
        assert parsed is None or WD.scene_key(parsed) == WD.scene_key(line["scene"]), line["prompt"]
        video, _ = WD.render(line["scene"], line["seed"])
        assert CH.check(video, line["scene"])["all"] == 1.0, line


def test_many_steps_bins_and_intervals():
    """The runner's summary: false accepts as bench/tinyworld.py counts them, by widened
    share (a bin is judged from --min-bin-hits hits), 'unknown' where the records carry no
    reuse_share; the certified thresholds the gate would use at each α."""
    ms = repo_scripts.load("bench/many_steps.py", "bench_many_steps")
    rng = random.Random(0)
    recs = []
    for i in range(80):
        share = (0.1, 0.3, 0.6, 0.9)[i % 4]
        bad = i % 4 == 3 and i < 20  # 5 of the 20 above 75% beyond tolerance
        recs.append({"outcome": "hit", "psnr": 20.0 if bad else 40.0, "ok": True, "ok_full": True,
                     "steps_total": 20, "steps_computed": 5, "same_scene": False,
                     "region_fraction": share, "features": {"reuse_share": share + rng.uniform(-0.01, 0.01)}})
    recs += [{"outcome": "miss", "psnr": 100.0, "ok": True, "ok_full": True, "steps_total": 20,
              "steps_computed": 20, "features": None, "region_fraction": None}] * 20
    row = ms.budget_row(recs, {}, 30.0, 0.05, 30)
    assert (row["requests"], row["accepted_reuses"], row["false_accepts"]) == (100, 80, 5)
    lo, hi = row["ci95"]
    assert lo < 5 / 80 < hi and not row["holds"]
    assert row["gate_hit_speedup_steps"] == 4.0 and row["workload_speedup_steps"] == 2000 / 800
    bins = row["by_reuse_share"]["bins"]
    assert [b["count"] for b in bins.values()] == [20, 20, 20, 20]
    assert bins[">75%"]["false_accepts"] == 5 and bins["<25%"]["false_accepts"] == 0
    assert not bins[">75%"]["over_alpha_with_30_hits"] and row["by_reuse_share"]["holds"]  # 20 < 30 hits
    # 5 of 20 is far above 5%: a rate of 5% gives that by chance 0.3% of the time (1 − Σ_{i<5} C(20,i)·.05^i·.95^(20−i))
    assert abs(bins[">75%"]["p_at_alpha"] - 0.0026) < 0.0002 and bins["<25%"]["p_at_alpha"] == 1.0
    assert abs(ms.p_at_alpha(2, 39, 0.05) - 0.587) < 0.001  # 2 of 39 at α = 5%: chance, though above α
    judged = ms.budget_row(recs, {}, 30.0, 0.05, 20)["by_reuse_share"]
    assert judged["bins"][">75%"]["over_alpha_with_30_hits"] and not judged["holds"]
    for r in recs:
        if r["features"]:
            r["features"].pop("reuse_share")
    row = ms.budget_row(recs, {}, 30.0, 0.05, 30)
    assert row["by_reuse_share"]["status"] == "unknown"
    assert row["by_widened_tile_share"]["bins"][">75%"]["count"] == 20
    thresholds = {"other": {"0.02": -3.0, "0.05": -2.0}, "other/75": {"0.05": -1.5}}
    assert ms.certified(thresholds, 0.1) == {"other": [0.05, -2.0], "other/75": [0.05, -1.5]}
    assert ms.certified(thresholds, 0.02) == {"other": [0.02, -3.0], "other/75": None}

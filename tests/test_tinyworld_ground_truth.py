"""The tiny world's ground truth: workload lines carry the scene they were written
from, the benchmark judges by that scene, and ``parse_caption`` reads exactly what
``caption()`` writes — anything else is a ValueError, never a wrong scene.

Plain pytest: no ComfyUI, no model.
"""
import json
import random
import re
from pathlib import Path

import pytest
import repo_scripts

from tinyworld import checker as CH
from tinyworld import world as WD

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = REPO / "bench" / "workloads"


def scene(*objects):
    return {"objects": [dict(zip(WD.ATTRIBUTES, o)) for o in objects]}


RED = ("circle", "red", "top left", "left")
BLUE = ("circle", "blue", "bottom right", "up")

# The caption language: each must parse to exactly this scene.
WRITTEN_BY_CAPTION = {
    "A Red Ball in the top left moves left": scene(RED),
    "  a red  ball in the TOP LEFT moves left ": scene(RED),
    "a red ball in the top left moves left and a blue ball in the bottom right moves up": scene(RED, BLUE),
    "a red ball in the top left moves left; a blue ball in the bottom right moves up": scene(RED, BLUE),
    "in the top left, a red ball moves left, while a blue ball moves up at the bottom right":
        scene(RED, BLUE),
    "a blue sphere rises in the lower right corner, while in the upper left corner, a crimson ball "
    "drifts leftwards": scene(BLUE, RED),
}

# Natural phrasings outside it, with the scene a person meant (None: no tiny-world scene,
# e.g. a "line" the world cannot draw). Each must parse to that scene or raise ValueError.
# The old parser returned a wrong scene for the first three (the last colour word won).
OTHER_PHRASINGS = {
    "a red ball in the top left moves left while a blue ball in the bottom right moves up": scene(RED, BLUE),
    "a red ball in the top left moves left. a blue ball in the bottom right moves up": scene(RED, BLUE),
    "a red ball in the top left moves left past a blue line": None,
    "a red ball in the upper left moves to the left": scene(RED),
    "a red ball falls down in the top left": scene(("circle", "red", "top left", "down")),
    "a red ball in the top left moves left, and a blue ball in the bottom right moves up": scene(RED, BLUE),
    "a red ball in the top left moves left and then a blue ball in the bottom right moves up": scene(RED, BLUE),
    "a red ball in the top left moves left, then a blue ball in the bottom right moves up": scene(RED, BLUE),
    "a red ball in the top left moves left as a blue ball in the bottom right moves up": scene(RED, BLUE),
    "a red ball in the top left moves left with a blue ball in the bottom right moving up": scene(RED, BLUE),
    "a red ball in the top left moves left whilst a blue ball in the bottom right moves up": scene(RED, BLUE),
    "a red ball in the top left moves left;a blue ball in the bottom right moves up": scene(RED, BLUE),
    "a red ball in the top left moves left, a blue ball in the bottom right moves up": scene(RED, BLUE),
    "a red ball in the top left moves left and a blue ball in the bottom right moves up and a green "
    "box in the top right sinks": None,
    "a red ball in the top left moves left.": scene(RED),
    "a red ball in the top left moves left quickly": scene(RED),  # speed: the world has one
    "the red ball in the top left moves left": scene(RED),
    "a red blue ball in the top left moves left": None,
    "a red ball in the top left moves left and right": None,
    "a red ball in the top left in the bottom right moves left": None,
    "a ball in the top left moves left": None,
    "": None,
}


@pytest.mark.parametrize("text", list(WRITTEN_BY_CAPTION))
def test_caption_language_parses_to_the_exact_scene(text):
    got = WD.parse_caption(text)
    assert got == WRITTEN_BY_CAPTION[text]  # the objects, their attributes, in text order


@pytest.mark.parametrize("text", list(OTHER_PHRASINGS))
def test_other_phrasings_are_read_right_or_refused(text):
    meant = OTHER_PHRASINGS[text]
    try:
        got = WD.parse_caption(text)
    except ValueError as e:
        assert repr(text) in str(e) and "caption()" in str(e)
        return
    assert meant is not None and WD.scene_key(got) == WD.scene_key(meant), (text, got)


def test_refusals_say_what_was_wrong():
    with pytest.raises(ValueError, match=r"unknown words or marks \['line', 'past'\]"):
        WD.parse_caption("a red ball in the top left moves left past a blue line")
    with pytest.raises(ValueError, match=r"unknown words or marks \['\.'\]"):
        WD.parse_caption("a red ball in the top left moves left. a blue ball in the bottom right moves up")
    with pytest.raises(ValueError, match="not in an order caption\\(\\) writes"):
        WD.parse_caption("a red ball in the top left moves left while a blue ball in the bottom right moves up")


def test_every_caption_round_trips():
    rng = random.Random(13)
    for _ in range(1500):
        s = WD.random_scene(rng)
        assert WD.scene_key(WD.parse_caption(WD.caption(s, canonical=True))) == WD.scene_key(s)
        for _ in range(4):
            text = WD.caption(s, rng)
            assert WD.scene_key(WD.parse_caption(text)) == WD.scene_key(s), text
            assert WD.scene_key(WD.parse_caption(text.upper())) == WD.scene_key(s), text
    # every one-object scene in every template with every synonym of each attribute
    for s in WD.all_single_scenes():
        o = s["objects"][0]
        for t in range(len(WD.OBJECT_TEMPLATES)):
            for k in range(4):
                text = WD.OBJECT_TEMPLATES[t].format(
                    c=WD.COLOUR_WORDS[o["colour"]][k % 3], s=WD.SHAPE_WORDS[o["shape"]][k % 3],
                    p=WD.POSITION_WORDS[o["position"]][k % 3], m=WD.MOTION_WORDS[o["motion"]][k])
                assert WD.parse_caption(text) == s, text


def test_a_word_missing_or_doubled_is_refused():
    """Every word of the grammar is needed exactly once: no reading may skip or reuse one."""
    rng = random.Random(7)
    for _ in range(150):
        words = WD.caption(WD.random_scene(rng), rng).split(" ")
        for i in range(len(words)):
            for edited in (words[:i] + words[i + 1:], words[:i + 1] + words[i:]):
                with pytest.raises(ValueError):
                    WD.parse_caption(" ".join(edited))


def test_checker_refuses_a_prompt_it_cannot_read():
    video, _ = WD.render(scene(RED))
    assert CH.check(video, "a red ball in the top left moves left")["all"] == 1.0
    with pytest.raises(ValueError):  # the old parser read this as a blue ball
        CH.check(video, "a red ball in the top left moves left past a blue line")


# ------------------------------------------------------------------ workload files
def _make_workloads():
    return repo_scripts.load("scripts/make_workloads.py", "make_workloads")


def _read(name):
    return (WORKLOADS / f"{name}.jsonl").read_text().splitlines()


def test_committed_workloads_are_what_the_generator_writes():
    """Regenerated in memory: every line, scene included, is the committed one."""
    generated = _make_workloads().workloads()
    assert sorted(p.stem for p in WORKLOADS.glob("*.jsonl")) == sorted(generated)
    for name, lines in generated.items():
        committed = _read(name)
        assert len(committed) == len(lines), name
        for number, (text, line) in enumerate(zip(committed, lines), 1):
            assert text == json.dumps(line), f"{name}.jsonl line {number}"


def test_every_workload_line_has_its_scene_and_the_strict_parser_agrees():
    speed_words = _make_workloads().SPEED_WORDS
    refused = reworded_refused = 0
    for path in sorted(WORKLOADS.glob("*.jsonl")):
        for number, text in enumerate(path.read_text().splitlines(), 1):
            line = json.loads(text)
            where = f"{path.name} line {number}"
            objects = line["scene"]["objects"]
            assert 1 <= len(objects) <= 2 and all(list(o) == list(WD.ATTRIBUTES) for o in objects), where
            if path.stem in ("serve_reworded", "unseen_edits", "serve_fresh", "iterate_fresh",
                             "calibration_wording", "calibration_untrained_wording", "serve_fresh_half",
                             "iterate_fresh_half", "calibration_held_out_half",
                             "calibration_held_out_half_scenes", "calibration_held_out_half_scenes_more"):  # the broad language or ignored words: read right or refused
                try:
                    parsed = WD.parse_caption(line["prompt"])
                except ValueError:
                    reworded_refused += 1
                    continue
                assert WD.scene_key(parsed) == WD.scene_key(line["scene"]), where
            elif set(re.findall(r"[a-z]+", line["prompt"])) & set(speed_words):
                with pytest.raises(ValueError):  # a speed word: not caption()'s language
                    WD.parse_caption(line["prompt"])
                refused += 1
            else:
                assert WD.scene_key(WD.parse_caption(line["prompt"])) == WD.scene_key(line["scene"]), where
    assert refused == 150  # novel's and drift's speed-word edits
    assert reworded_refused > 120  # most of the rewording is not caption()'s language


# ------------------------------------------------------------------ the benchmark
def _bench():
    return repo_scripts.load("bench/tinyworld.py", "bench_tw")


def test_benchmark_compares_stored_scenes_not_prose(tmp_path):
    lines = [  # prose that misled the old parser: it read both of the first two as one blue ball
        {"prompt": "a red ball in the top left moves left past a blue line", "seed": 1, "scene": scene(RED)},
        {"prompt": "a blue ball in the top left moves left", "seed": 1,
         "scene": scene(("circle", "blue", "top left", "left"))},
        {"prompt": "a red ball in the top left moves left while a blue ball in the bottom right moves up",
         "seed": 2, "scene": scene(RED, BLUE)},
        {"prompt": "in the lower right corner, a azure sphere climbs upwards and a red ball in the top left "
                   "moves left", "seed": 2, "scene": scene(BLUE, RED)},
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    bench = _bench()
    _, got = bench.load_workload(str(path))
    assert not bench.same_scene(got[0]["scene"], got[1]["scene"])
    assert bench.same_scene(got[2]["scene"], got[3]["scene"])  # object order does not matter
    assert not bench.same_scene(got[0]["scene"], got[2]["scene"])
    video, _ = WD.render(scene(RED))
    assert bench.check_ok(video, got[0]["scene"]) and not bench.check_ok(video, got[1]["scene"])
    with pytest.raises(TypeError, match="never parses prompts"):
        bench.check_ok(video, got[0]["prompt"])


def test_benchmark_refuses_a_workload_without_scenes(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"prompt": "a red ball in the top left moves left", "seed": 1}) + "\n\n"
                    + json.dumps({"prompt": "x", "seed": 2, "scene": {"objects": [{"shape": "line"}]}}) + "\n")
    with pytest.raises(ValueError, match=r"old\.jsonl line 1 has no \"scene\".*scripts/make_workloads\.py"):
        _bench().load_workload(str(path))
    path.write_text(json.dumps({"prompt": "x", "seed": 2, "scene": {"objects": [{"shape": "line"}]}}) + "\n")
    with pytest.raises(ValueError, match=r"line 1 has a scene that is not a tiny-world scene"):
        _bench().load_workload(str(path))
    assert all(len(_bench().load_workload(p.stem)[1]) for p in WORKLOADS.glob("*.jsonl"))

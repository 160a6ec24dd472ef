"""The tiny world's broad language: tinyworld.language's families, their split,
and that every phrasing describes exactly its scene.

The scene check reads each phrasing with keyword tables of its own (below), not the
generator's lexicon: each attribute piece must name its object's value and no other, plain
pieces must name no attribute, and the pieces must make up the text. Fast: MiniLM's
tokenizer, no diffusion model, except one small run of bench/studies/phrasing.py.
"""
import json
import random
import re
from pathlib import Path

import pytest
import repo_scripts

from tinyworld import language as LANG
from tinyworld import text as TXT
from tinyworld import world as WD

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tinyworld" / "carnator_tinyworld_wan21.safetensors"

# --------------------------------------------------------------- an independent reader
COLOUR_KEYS = {"red": {"red", "crimson", "scarlet", "ruby", "cherry"},
               "green": {"green", "emerald", "lime", "grass"},
               "blue": {"blue", "azure", "cobalt", "navy", "sky"},
               "yellow": {"yellow", "golden", "amber", "lemon"}}
SHAPE_KEYS = {"square": {"square", "box", "block", "cube"},
              "circle": {"circle", "ball", "sphere", "disc", "dot", "round"},
              "triangle": {"triangle", "wedge", "pyramid", "triangular"}}
VERTICAL_KEYS = {"top": {"top", "upper"}, "bottom": {"bottom", "lower"}}
HORIZONTAL_KEYS = {"left": {"left"}, "right": {"right"}}
MOTION_KEYS = {"left": {"left", "leftwards"}, "right": {"right", "rightwards"},
               "up": {"up", "upwards", "top", "rise", "rises", "rising", "climb", "climbs", "climbing",
                      "ascend", "ascends", "ascending"},
               "down": {"down", "downwards", "bottom", "fall", "falls", "falling", "sink", "sinks",
                        "sinking", "drop", "drops", "dropping", "descend", "descends", "descending"}}
MOTION_VERBS = {"move", "moves", "moving", "drift", "drifts", "drifting", "slide", "slides", "sliding",
                "travel", "travels", "travelling", "glide", "glides", "gliding", "head", "heads", "heading",
                "go", "goes", "going", "shift", "shifts", "shifting", "float", "floats", "floating"}
ATTRIBUTE_WORDS = set().union(*COLOUR_KEYS.values(), *SHAPE_KEYS.values(), *VERTICAL_KEYS.values(),
                              *HORIZONTAL_KEYS.values(), *MOTION_KEYS.values(), MOTION_VERBS)


def words(text):
    return set(re.findall(r"[a-z]+", text.lower()))


def values(text, keys):
    w = words(text)
    return {v for v, k in keys.items() if w & k}


def read_piece(text, attribute):
    """What an attribute piece says, by the keyword tables; None where it says anything else."""
    w = words(text)
    if attribute == "colour":
        return next(iter(values(text, COLOUR_KEYS))) if len(values(text, COLOUR_KEYS)) == 1 and not (
            w & (ATTRIBUTE_WORDS - set().union(*COLOUR_KEYS.values()))) else None
    if attribute == "shape":
        return next(iter(values(text, SHAPE_KEYS))) if len(values(text, SHAPE_KEYS)) == 1 and not (
            w & (ATTRIBUTE_WORDS - set().union(*SHAPE_KEYS.values()))) else None
    if attribute == "position":
        v, h = values(text, VERTICAL_KEYS), values(text, HORIZONTAL_KEYS)
        clean = not (w & (set().union(*COLOUR_KEYS.values(), *SHAPE_KEYS.values(), MOTION_VERBS)))
        return f"{v.pop()} {h.pop()}" if len(v) == len(h) == 1 and clean else None
    if attribute == "motion":
        m = values(text, MOTION_KEYS)
        clean = not (w & set().union(*COLOUR_KEYS.values(), *SHAPE_KEYS.values()))
        return m.pop() if len(m) == 1 and clean else None
    raise ValueError(attribute)


def assert_describes(p: LANG.Phrasing, scene):
    objs = scene["objects"]
    joined = "".join(t for t, _ in p.pieces)
    assert p.text.lower().rstrip(".") == joined.lower().rstrip("."), p.text
    said = {}
    for text, tag in p.pieces:
        if tag is None:
            assert not words(text) & ATTRIBUTE_WORDS, (p.text, text)
            continue
        i, attribute = tag
        assert read_piece(text, attribute) == objs[i][attribute], (p.text, text, objs[i])
        said.setdefault(i, set()).add(attribute)
    assert said == {i: set(WD.ATTRIBUTES) for i in range(len(objs))}, p.text
    # and read whole, without the pieces: exactly the scene's colours and shapes
    assert values(p.text, COLOUR_KEYS) == {o["colour"] for o in objs}, p.text
    assert values(p.text, SHAPE_KEYS) == {o["shape"] for o in objs}, p.text


def phrasings(families, n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        scene = WD.random_scene(rng, 1 + i % 2)
        out.append((scene, LANG.compose(scene, rng, families)))
    return out


@pytest.fixture(scope="module")
def train_sample():
    return phrasings(LANG.TRAIN_FAMILIES, 3000, 1)


@pytest.fixture(scope="module")
def held_sample():
    return phrasings(LANG.HELD_OUT_FAMILIES, 1500, 2)


def used_families(p):
    f = p.families
    return set(f["clause"]) | {f[k] for k in ("joiner", "frame", "surface") if f[k]}


# --------------------------------------------------------------- the split
def test_families_split_whole_and_every_kind_on_both_sides():
    train, held = set(LANG.TRAIN_FAMILIES), set(LANG.HELD_OUT_FAMILIES)
    assert not train & held
    assert train | held == set(LANG.ALL_FAMILIES)
    for kind in LANG.KINDS:
        assert any(LANG.family_kind(f) == kind for f in train), kind
        assert any(LANG.family_kind(f) == kind for f in held), kind
    with pytest.raises(ValueError, match="unknown phrasing family"):
        LANG.phrase(WD.random_scene(random.Random(0)), random.Random(0), ["clause.nonsense"])


def test_training_phrasings_use_training_families_only(train_sample, held_sample):
    assert set().union(*(used_families(p) for _, p in train_sample)) == set(LANG.TRAIN_FAMILIES)
    assert set().union(*(used_families(p) for _, p in held_sample)) == set(LANG.HELD_OUT_FAMILIES)
    # read from the text, not the generator's bookkeeping: the held-out structures never occur
    held_marks = [r"[^,] while ", r"[^,] whereas ", r"\. meanwhile, ", r"\. at the same time, ", r"\balso, ",
                  r"; also ", r"in this video we see", r"here, in this clip",
                  r"background is plain grey", r"\(plain grey background\)", r"\bis (in|at|near|on) the ",
                  r"^[a-z]+ing\b"]
    for _, p in train_sample:
        t = p.text.lower()
        assert not any(re.search(m, t) for m in held_marks), p.text
        assert p.families["surface"] in ("surface.lower", "surface.sentence")
        assert p.text == p.text.lower() or p.text[0].isupper() and p.text.endswith(".")


def test_deterministic_and_varied():
    scene = WD.random_scene(random.Random(5), 2)
    for fams in (LANG.TRAIN_FAMILIES, LANG.HELD_OUT_FAMILIES):
        a = [LANG.phrase(scene, random.Random(s), fams) for s in range(40)]
        assert a == [LANG.phrase(scene, random.Random(s), fams) for s in range(40)]
        assert len(set(a)) >= 38
    caption = WD.caption(scene, random.Random(1))
    assert caption == WD.caption(scene, random.Random(1))  # caption() itself is untouched


def test_every_phrasing_describes_exactly_its_scene(train_sample, held_sample):
    for scene, p in train_sample + held_sample:
        assert_describes(p, scene)


def test_reader_catches_a_wrong_word():
    scene = WD.random_scene(random.Random(3), 2)
    p = LANG.compose(scene, random.Random(3), LANG.HELD_OUT_FAMILIES)
    other = {"red": "blue", "blue": "red", "green": "yellow", "yellow": "green"}
    bad = [(other[scene["objects"][t[0]]["colour"]] if t and t[1] == "colour" else s, t) for s, t in p.pieces]
    wrong = LANG.Phrasing("".join(s for s, _ in bad), tuple(bad), p.families)
    with pytest.raises(AssertionError):
        assert_describes(wrong, scene)
    extra = LANG.Phrasing(p.text + " past a blue line", p.pieces + ((" past a blue line", None),), p.families)
    with pytest.raises(AssertionError):
        assert_describes(extra, scene)


def test_held_out_words_all_occur_in_training_phrasings(train_sample, held_sample):
    seen = set().union(*(words(p.text) for _, p in train_sample))
    seen_marks = set().union(*(set(re.findall(r"[^\w\s]", p.text)) for _, p in train_sample))
    held = set().union(*(words(p.text) for _, p in held_sample))
    held_marks = set().union(*(set(re.findall(r"[^\w\s]", p.text)) for _, p in held_sample))
    assert held <= seen, sorted(held - seen)
    assert held_marks <= seen_marks, sorted(held_marks - seen_marks)
    # and by construction: every literal word of a held-out template is a training word
    literal = {w for f in LANG.HELD_OUT_FAMILIES
               for t in {**LANG.CLAUSES, **LANG.JOINERS, **LANG.FRAMES}.get(f, ())
               for w in words(re.sub(r"\{\w+\}", " ", t))}
    assert literal <= seen, sorted(literal - seen)


def test_untrained_calibration_families_lie_outside_the_split_in_training_words(train_sample):
    """The calibration's untrained structures: neither trained on nor held out (so no workload's
    and no training caption's), every phrasing exactly its scene, every word a training word."""
    own = set(LANG.UNTRAINED_CALIBRATION_FAMILIES) - {"surface.lower", "surface.sentence"}
    assert own and not own & set(LANG.ALL_FAMILIES)
    assert {LANG.family_kind(f) for f in own} == {"clause", "joiner", "frame"}
    sample = phrasings(LANG.UNTRAINED_CALIBRATION_FAMILIES, 400, 4)
    assert set().union(*(used_families(p) for _, p in sample)) == set(LANG.UNTRAINED_CALIBRATION_FAMILIES)
    seen = set().union(*(words(p.text) for _, p in train_sample))
    for scene, p in sample:
        assert_describes(p, scene)
        assert words(p.text) <= seen, sorted(words(p.text) - seen)
    with pytest.raises(ValueError):
        LANG.training_caption(sample[0][0], random.Random(0), 1.0, tuple(own) + ("surface.lower",))


def test_the_held_out_halves_split_the_held_out_families_and_each_phrases_every_scene():
    """Calibration pairs in one half, the workloads served against them in the other: apart,
    together the held-out families, each able to word a two-object scene (clause, joiner, surface)."""
    cal, serving = set(LANG.HELD_OUT_CALIBRATION_HALF), set(LANG.HELD_OUT_SERVING_HALF)
    assert not cal & serving and cal | serving == set(LANG.HELD_OUT_FAMILIES)
    for half in (cal, serving):
        assert {LANG.family_kind(f) for f in half} == set(LANG.KINDS)
        for scene, p in phrasings(tuple(sorted(half)), 60, 5):
            assert_describes(p, scene)
            assert used_families(p) <= half


def test_phrasings_fit_the_encoder(train_sample, held_sample):
    texts = [p.text for _, p in train_sample + held_sample]
    assert max(TXT.token_counts(texts)) <= TXT.TEXT_LEN - 1
    with pytest.raises(ValueError, match="within 5 tokens"):
        LANG.phrase(WD.random_scene(random.Random(0), 2), random.Random(0), max_tokens=5)


def test_clauses_never_run_into_their_neighbours(train_sample, held_sample):
    """A participle or bare colour opens a clause only after a break, and a clause ending
    on its noun phrase is followed by one (else '… rises while drifting right, a red dot …'
    gives one object two motions)."""
    for _, p in train_sample + held_sample:
        t = p.text.lower()
        assert not re.search(r"\b(while|whereas|as|and|how) [a-z]+ing\b", t), p.text
        assert not re.search(r"ing\b[^:.;]*: (an?|one) ([a-z]+ ){1,6}(and|as|while|whereas) ", t), p.text


# --------------------------------------------------------------- training captions
def _train_script():
    return repo_scripts.load("scripts/train_tinyworld.py", "train_tinyworld")


def test_training_bank_language_option(tmp_path):
    tr = _train_script()
    rng = random.Random(7)
    expected = []
    for _ in range(50):
        s = WD.random_scene(rng)
        expected.append((s, WD.caption(s, rng)))
    assert list(zip(*tr.bank_captions(50, 7))) == expected  # default: the committed model's bank
    scenes, caps = tr.bank_captions(400, 7, "broad", 0.5)
    assert caps == tr.bank_captions(400, 7, "broad", 0.5)[1]

    def caption_language(c):
        try:
            WD.parse_caption(c)
            return True
        except ValueError:
            return False
    own = sum(map(caption_language, caps))
    assert 0.4 < own / len(caps) < 0.65, own  # about half caption()'s, half the families'
    assert all(caption_language(c) for c in tr.bank_captions(400, 7, "broad", 0.0)[1])
    broad_only = tr.bank_captions(60, 7, "broad", 1.0)
    for s, c in zip(*broad_only):
        assert not re.search(r"[^,] while |\. meanwhile, |in this video we see", c.lower()), c
    assert tr.bank_path("/x", 10, 1, "caption", caps) == "/x/bank_10_1_v3.safetensors"
    assert tr.bank_path("/x", 10, 1, "broad", caps) != tr.bank_path("/x", 10, 1, "broad", caps[1:])
    bank = tr.Bank(6, 7, cache_dir=str(tmp_path), language="broad")  # encodes 6 captions
    assert bank.states.shape == (6, TXT.TEXT_LEN, TXT.STATE_DIM) and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(ValueError, match="--language"):
        tr.bank_captions(2, 1, "french")


def test_language_revision_2_adds_training_families_and_revision_1_still_draws_alone():
    """The retraining recipe went on in revision 2 from a checkpoint trained on revision 1:
    `broad` must keep drawing revision 1 only (the recipe's earlier steps), `broad2` all."""
    tr = _train_script()
    added = set(LANG.ADDED_IN_REVISION_2)
    assert added <= set(LANG.TRAIN_FAMILIES) and not added & set(LANG.HELD_OUT_FAMILIES)
    assert set(LANG.TRAIN_FAMILIES_REVISION_1) == set(LANG.TRAIN_FAMILIES) - added
    rng = random.Random(9)
    scenes = [WD.random_scene(rng) for _ in range(400)]
    first = [LANG.compose(s, random.Random(i), LANG.TRAIN_FAMILIES_REVISION_1) for i, s in enumerate(scenes)]
    assert not set().union(*map(used_families, first)) & added
    second = [LANG.compose(s, random.Random(i), LANG.TRAIN_FAMILIES) for i, s in enumerate(scenes)]
    assert added <= set().union(*map(used_families, second))
    assert tr.bank_captions(300, 7, "broad2", 1.0)[1] != tr.bank_captions(300, 7, "broad", 1.0)[1]
    with pytest.raises(ValueError, match="held-out"):
        LANG.training_caption(scenes[0], random.Random(0), 1.0, LANG.ALL_FAMILIES)


# --------------------------------------------------------------- the benchmark, tiny
@pytest.mark.skipif(not MODEL.exists(), reason="committed tiny-world model not present")
def test_phrasing_benchmark_smoke(tmp_path):
    mod = repo_scripts.load("bench/studies/phrasing.py", "bench_phrasing")
    out = tmp_path / "phrasing.json"
    res = mod.main(["--scenes", "2", "--held-out", "2", "--training", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["held_out_phrasing_all_right"] == res["held_out_phrasing_all_right"]
    for key in ("held_out_phrasing", "training_phrasing", "caption_phrasing", "canonical_caption"):
        assert 0.0 <= saved[f"{key}_all_right"] <= 1.0
        assert set(saved[f"{key}_per_attribute"]) == {"shape", "colour", "position", "motion", "count"}
    assert saved["counts"]["prompts"] == {"canonical": 2, "caption": 2, "training": 4, "held_out": 4}
    assert saved["pairs"]["held_out_pairs"]["n"] == 2 and saved["held_out_pairs_within_30db"] is not None
    assert saved["settings"]["model"].endswith("carnator_tinyworld_wan21.safetensors")
    assert saved["command"].startswith("python bench/studies/phrasing.py")
    assert set(saved["targets"]) == {"held_out_all_right", "held_out_per_attribute", "gap_to_training",
                                     "held_out_pairs_within_bound"}
    held = [r for r in saved["records"] if r["row"] == "held_out"]
    assert all(set(r["families"]["clause"]) <= set(LANG.HELD_OUT_FAMILIES) for r in held)


def test_phrasing_benchmark_draws_more_training_phrasings_without_moving_the_others():
    """--training K adds training-family phrasings after the held-out ones: the prompts an
    earlier run measured (first training phrasing, every held-out one) stay the same."""
    import random
    mod = repo_scripts.load("bench/studies/phrasing.py", "bench_phrasing")
    scene = {"objects": [{"shape": "square", "colour": "red", "position": "top left", "motion": "right"},
                         {"shape": "circle", "colour": "blue", "position": "bottom right", "motion": "up"}]}
    one = mod.prompts_for(scene, random.Random(7), held_out=3, training=1)
    three = mod.prompts_for(scene, random.Random(7), held_out=3, training=3)
    assert three[:len(one)] == one
    extra = three[len(one):]
    assert [p["row"] for p in extra] == ["training", "training"]
    texts = [p["prompt"] for p in three if p["row"] == "training"]
    assert len(set(texts)) == 3
    assert all(set(p["families"]["clause"]) <= set(LANG.TRAIN_FAMILIES) for p in extra)


def test_phrasing_benchmark_prompts_are_the_ones_earlier_runs_measured():
    """Revision 2 of the language added training families; the benchmark still draws its
    prompts as every committed measurement did, so the runs before and after compare."""
    import random
    mod = repo_scripts.load("bench/studies/phrasing.py", "bench_phrasing")
    saved = json.loads((REPO / "bench/results/studies/phrasing_consistency_21124.json").read_text())
    st = saved["settings"]
    scenes = mod.scenes_and_seeds(6, st["seed"])
    got = [p["prompt"] for i, (scene, _) in enumerate(scenes)
           for p in mod.prompts_for(scene, random.Random(st["phrase_seed"] * 1_000_003 + i), 3, 3)]
    assert got == [r["prompt"] for r in saved["records"] if r["scene"] < 6]


# --------------------------------------------------------------- words the world ignores
def test_ignored_words_are_added_without_changing_what_the_text_says(held_sample):
    """The fresh-wording workloads' prompts: one to three words the world ignores around an
    unchanged phrasing, never an attribute word; no training or caption() phrasing has a speed
    or a shade (a filler may share a word with a frame)."""
    ignored = {w for ws in LANG.IGNORED_WORDS.values() for phrase in ws for w in re.findall(r"[a-z0-9]+", phrase)}
    assert not ignored & ATTRIBUTE_WORDS
    marks = ignored - {"a"}  # the words only an ignored word brings
    rng = random.Random(4)
    added_counts = set()
    for scene, p in held_sample[:600]:
        text = LANG.with_ignored_words(p, rng, max_tokens=None)
        extra = [w for w in re.findall(r"[a-z0-9]+", text.lower()) if w in marks]
        added_counts.add(len(set(extra)))
        assert extra, text
        # the phrasing is still there, in order, with only ignored words between its words
        kept = [w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in ignored]
        assert kept == [w for w in re.findall(r"[a-z0-9]+", p.text.lower()) if w not in ignored], text
        assert values(text, COLOUR_KEYS) == {o["colour"] for o in scene["objects"]}, text
        assert values(text, SHAPE_KEYS) == {o["shape"] for o in scene["objects"]}, text
    assert {1, 2} <= added_counts
    unsaid = set(LANG.IGNORED_WORDS["speed"] + LANG.IGNORED_WORDS["shade"])
    for _, p in phrasings(LANG.TRAIN_FAMILIES, 400, 7):
        assert not words(p.text) & unsaid, p.text
    assert not any(words(WD.caption(WD.random_scene(random.Random(i)), random.Random(i))) & unsaid
                   for i in range(400))


def test_ignored_words_respect_the_encoder_window(held_sample):
    rng = random.Random(5)
    for _, p in held_sample[:300]:
        assert LANG.token_count(LANG.with_ignored_words(p, rng)) <= LANG.MAX_TOKENS


def test_calibration_wording_pairs_carry_ignored_words_of_their_own():
    """bench/workloads/calibration_wording.jsonl: every prompt is a world.caption() with at least
    one word from the calibration's vocabulary and none from the fresh-wording workloads'; with
    those words taken out it reads back as exactly its scene. A third of the pairs are one scene
    worded twice, the rest are edits."""
    vocab = {k: {w for phrase in ws for w in re.findall(r"[a-z0-9]+", phrase)}
             for k, ws in LANG.CALIBRATION_IGNORED_WORDS.items()}
    own = set().union(*vocab.values())
    theirs = {w for ws in LANG.IGNORED_WORDS.values() for phrase in ws for w in re.findall(r"[a-z0-9]+", phrase)}
    assert set(vocab) == set(LANG.IGNORED_WORDS) and not own & theirs and not own & ATTRIBUTE_WORDS
    lines = [json.loads(t) for t in (REPO / "bench/workloads/calibration_wording.jsonl").read_text().splitlines()]
    pairs = {}
    for line in lines:
        said = [w for w in re.findall(r"[a-z0-9]+", line["prompt"].lower())]
        assert set(said) & own and not set(said) & (theirs - {"a"}), line["prompt"]
        plain = line["prompt"]
        for filler in LANG.CALIBRATION_IGNORED_WORDS["filler"]:
            if plain.lower().startswith(filler + " "):
                plain = plain[len(filler) + 1:]
        for word in LANG.CALIBRATION_IGNORED_WORDS["speed"] + LANG.CALIBRATION_IGNORED_WORDS["shade"]:
            plain = re.sub(rf"\s*\b{word}\b", "", plain, flags=re.IGNORECASE).strip()
        assert WD.scene_key(WD.parse_caption(plain)) == WD.scene_key(line["scene"]), (line["prompt"], plain)
        pairs.setdefault(line["group"], []).append(line)
    kinds = {}
    for group in pairs.values():
        a, b = group
        same = WD.scene_key(a["scene"]) == WD.scene_key(b["scene"])
        assert same == (a["kind"] == "worded_paraphrase") and a["prompt"] != b["prompt"]
        kinds[a["kind"]] = kinds.get(a["kind"], 0) + 1
    assert len(pairs) == 240 and kinds["worded_paraphrase"] == 80 and kinds["worded_edit"] == 160

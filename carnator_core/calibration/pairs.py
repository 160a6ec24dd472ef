"""Prompt pairs in plain English for calibrating the gate on a user's own model.

Calibration needs pairs of requests like the ones a cache will meet: a prompt and a
neighbour — reworded, edited in one attribute, mirrored, with an object added or removed,
or unrelated. ``pairs(base_prompts, n)`` derives them from any list of base prompts by
word-level edit operators that know only English (colours, left/right, up/down, motion
verbs, "and a …" clauses), never a particular model's caption grammar: the user's own
prompts when they have some, else ``BUILTIN_PROMPTS``. An operator that does not apply to a
prompt (no colour word to change) is skipped for that prompt.

Each pair is ``{"a": prompt, "b": prompt, "kind": str, "group": int}``. Deterministic for a
given seed.
"""
from __future__ import annotations

import random
import re

BUILTIN_PROMPTS = (
    "a red ball rolls to the left across a green field",
    "a white cat walks to the right along a wooden fence",
    "a blue car drives to the left down an empty street at night",
    "a yellow kite rises up into a clear sky",
    "a small boat drifts to the right on a calm lake at sunset",
    "a black dog runs to the left on a sandy beach",
    "a green leaf falls down past a brick wall",
    "a brown horse gallops to the right across a meadow",
    "an orange fish swims to the left in a blue aquarium",
    "a purple balloon floats up above a city square",
    "a grey train moves to the right through snowy hills",
    "a pink flower sways in the wind in the bottom left of a garden",
    "a red square slides to the right in the top left",
    "a blue circle moves down in the bottom right",
    "a yellow triangle moves up in the top right",
    "a silver drone flies to the left over a forest",
)

COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "white", "black",
           "brown", "grey", "silver", "golden")
# Paraphrase vocabulary: a word and words that mean the same in a video prompt.
SYNONYMS = {
    "moves": ("travels", "glides", "slides"), "slides": ("glides", "moves"),
    "rolls": ("tumbles",), "walks": ("strolls", "wanders"), "runs": ("dashes", "sprints"),
    "drives": ("travels", "rides"), "floats": ("drifts", "hovers"), "drifts": ("floats", "glides"),
    "flies": ("soars", "glides"), "falls": ("drops", "sinks"), "rises": ("climbs", "ascends"),
    "swims": ("glides", "paddles"), "gallops": ("races", "runs"),
    "small": ("little", "tiny"), "big": ("large", "huge"), "calm": ("still", "quiet"),
    "red": ("crimson", "scarlet"), "blue": ("azure", "cobalt"), "yellow": ("golden", "amber"),
    "green": ("emerald",), "grey": ("gray",), "square": ("block",), "circle": ("disc", "ring"),
    "triangle": ("pyramid",), "ball": ("sphere",), "car": ("automobile",), "dog": ("puppy",),
    "street": ("road",), "field": ("meadow",), "top": ("upper",), "bottom": ("lower",),
}
MIRROR = {"left": "right", "right": "left", "leftwards": "rightwards", "rightwards": "leftwards",
          "up": "down", "down": "up", "upwards": "downwards", "downwards": "upwards",
          "rises": "falls", "falls": "rises", "top": "bottom", "bottom": "top"}
HORIZONTAL = {"left": "right", "right": "left", "leftwards": "rightwards", "rightwards": "leftwards"}
MOTION_SWAP = {"moves": "stays still", "slides": "spins", "rolls": "bounces", "walks": "runs",
               "runs": "walks", "drives": "turns", "floats": "spins", "flies": "hovers",
               "swims": "turns", "falls": "spins", "rises": "spins", "gallops": "trots",
               "drifts": "spins", "travels": "spins", "sways": "spins"}
SPEED_WORDS = ("slowly", "quickly", "gently", "steadily")
EXTRA_OBJECTS = ("a {c} ball bounces in the top right", "a {c} bird flies to the left above it",
                 "a {c} square moves up in the bottom left", "a {c} cube spins in the corner")

KINDS = ("paraphrase", "colour", "mirror", "left_right", "motion", "speed", "add_object",
         "remove_object", "unrelated")
MULTI_STEP = ("chain", "session")
# An editing session reuses the last request computed in full, often several edits back:
# "chain" applies two or three of these in a row (``pairs(kinds=("chain",))``); "session"
# one to eight, drawn with replacement and with removals, as a long session drifts. Measured
# on the tiny world: a gate calibrated on chains of two or three edits broke its
# budget on editing sessions, whose reuse sources were up to eight edits back.
CHAIN_STEPS = ("paraphrase", "colour", "mirror", "left_right", "motion", "speed", "add_object")
SESSION_STEPS = CHAIN_STEPS + ("remove_object",)
SESSION_LENGTHS = tuple(range(1, 9))

WORD = re.compile(r"[A-Za-z]+")


def _replace_words(prompt: str, table: dict, rng: random.Random, limit: int | None = None) -> str:
    """Replace words found in ``table`` (a value or a tuple of choices), keeping case."""
    hits = [m for m in WORD.finditer(prompt) if m.group().lower() in table]
    if limit is not None and hits:
        hits = rng.sample(hits, min(limit, len(hits)))
    out, last = [], 0
    for m in sorted(hits, key=lambda m: m.start()):
        choice = table[m.group().lower()]
        word = rng.choice(choice) if isinstance(choice, tuple) else choice
        out += [prompt[last:m.start()], word]
        last = m.end()
    return "".join(out + [prompt[last:]])


def edit(prompt: str, kind: str, rng: random.Random, others: list[str] = ()) -> str | None:
    """``prompt`` changed by one operator, or None when the operator does not apply."""
    words = {w.lower() for w in WORD.findall(prompt)}
    if kind == "paraphrase":
        out = _replace_words(prompt, SYNONYMS, rng, limit=2)
        if out == prompt and " in the " in prompt and ", " not in prompt:
            head, _, place = prompt.partition(" in the ")
            out = f"in the {place}, {head}"  # same scene, the clause moved to the front
    elif kind == "colour":
        found = [c for c in COLOURS if c in words]
        if not found:
            return None
        old = rng.choice(found)
        out = _replace_words(prompt, {old: tuple(c for c in COLOURS if c not in words)}, rng, limit=1)
    elif kind == "mirror":
        out = _replace_words(prompt, MIRROR, rng)
    elif kind == "left_right":
        out = _replace_words(prompt, HORIZONTAL, rng)
    elif kind == "motion":
        verbs = {w: MOTION_SWAP[w] for w in words if w in MOTION_SWAP}
        out = _replace_words(prompt, verbs, rng, limit=1) if verbs else prompt
    elif kind == "speed":
        verbs = [m for m in WORD.finditer(prompt) if m.group().lower() in MOTION_SWAP]
        if not verbs:
            return None
        m = verbs[0]
        out = f"{prompt[:m.end()]} {rng.choice(SPEED_WORDS)}{prompt[m.end():]}"
    elif kind == "add_object":
        out = f"{prompt} and {rng.choice(EXTRA_OBJECTS).format(c=rng.choice(COLOURS))}"
    elif kind == "remove_object":
        for sep in (" and ", "; "):
            if sep in prompt:
                out = prompt.split(sep)[0]
                break
        else:
            return None
    elif kind == "unrelated":
        pool = [p for p in others if p != prompt]
        out = rng.choice(pool) if pool else None
    elif kind == "chain":
        out = prompt
        for step in rng.sample(CHAIN_STEPS, rng.choice((2, 3))):
            out = edit(out, step, rng, others) or out
    elif kind == "session":
        out = prompt
        for _ in range(rng.choice(SESSION_LENGTHS)):
            out = edit(out, rng.choice(SESSION_STEPS), rng, others) or out
    else:
        raise ValueError(f"unknown pair kind {kind!r} (known: {', '.join(KINDS + MULTI_STEP)})")
    return out if out and out != prompt else None


def pairs(base_prompts: list[str] | tuple[str, ...] = BUILTIN_PROMPTS, n: int = 60,
          kinds: tuple[str, ...] = KINDS, seed: int = 0) -> list[dict]:
    """``n`` pairs cycling through ``kinds``, each from a base prompt drawn in turn.

    A remove_object pair starts from the prompt with an object added, so it applies to
    single-object prompts too."""
    base = [p.strip() for p in base_prompts if p and p.strip()]
    if not base:
        raise ValueError("no base prompts to derive calibration pairs from")
    rng = random.Random(seed)
    out, tries = [], 0
    while len(out) < n and tries < 20 * n:
        kind = kinds[tries % len(kinds)]
        a = base[rng.randrange(len(base))]
        tries += 1
        if kind == "remove_object" and " and " not in a and "; " not in a:
            a = edit(a, "add_object", rng) or a
        b = edit(a, kind, rng, base)
        if b is not None:
            out.append({"a": a, "b": b, "kind": kind, "group": len(out)})
    if len(out) < n:
        raise ValueError(f"only {len(out)} of {n} pairs could be derived from {len(base)} base "
                         f"prompts; give more or longer prompts")
    return out


def derived_pairs(base_prompts, n: int, seed: int = 0) -> list[dict]:
    """What a calibration measures: half single edits of every kind, a quarter chains of two
    or three edits, a quarter editing-session chains of one to eight (what an editing
    session offers), numbered in that order."""
    chains = sessions = n // 4
    out = pairs(base_prompts, n - chains - sessions, seed=seed)
    for kind, count, offset in (("chain", chains, 1), ("session", sessions, 2)):
        if count:
            out += [{**p, "group": len(out) + i}
                    for i, p in enumerate(pairs(base_prompts, count, (kind,), seed=seed + offset))]
    return out


def pairs_from_text(text: str, n: int, seed: int = 0) -> list[dict]:
    """Pairs from a user's list (one prompt per line). A line ``A || B`` is a pair as given;
    plain lines are base prompts the operators derive pairs from. Empty: the built-in list."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip() and not ln.startswith("#")]
    given = [ln.split("||") for ln in lines if "||" in ln]
    plain = [ln for ln in lines if "||" not in ln]
    out = [{"a": a.strip(), "b": b.strip(), "kind": "given", "group": i}
           for i, (a, b, *_) in enumerate(given)]
    if len(out) < n:
        derived = derived_pairs(plain or BUILTIN_PROMPTS, n - len(out), seed=seed)
        out += [{**p, "group": len(out) + i} for i, p in enumerate(derived)]
    return out


def with_traffic(pairs: list[dict], traffic: list[dict]) -> list[dict]:
    """``pairs`` and pairs made from prompts worded as the user's traffic is, each named as its
    own population (``"stratum"``: generic, traffic), so the calibration certifies every budget
    in each (calibration.fit.certify_strata); groups renumbered after ``pairs``'."""
    first = 1 + max((int(p["group"]) for p in pairs), default=-1)
    return ([{**p, "stratum": "generic"} for p in pairs]
            + [{**p, "stratum": "traffic", "group": first + i} for i, p in enumerate(traffic)])


def pairs_from_texts(text: str, traffic_text: str, n: int, seed: int = 0) -> list[dict]:
    """``pairs_from_text(text, n)``, and where ``traffic_text`` holds prompts (worded as the
    user's traffic is) as many pairs again from them, each set its own population
    (``with_traffic``)."""
    chosen = pairs_from_text(text, n, seed=seed)
    if not (traffic_text or "").strip():
        return chosen
    return with_traffic(chosen, pairs_from_text(traffic_text, n, seed=seed + 1))


# ------------------------------------------------------------------ pools for the cheap calibration
# Paraphrases give same-scene evidence, whose decisions are deep (cheap to label) and rarely
# fail: the cell a small budget can certify (on the tiny world a clean pair costs ~2.4
# generation-equivalents). After the lead block (``cheap.paraphrase_lead``) most pairs stay
# paraphrases, as most requests people send again are.
PARAPHRASE_SHARE = 0.7

EDIT_KINDS = tuple(k for k in KINDS if k != "paraphrase") + MULTI_STEP


def pool(base_prompts, n: int, paraphrase_share: float = PARAPHRASE_SHARE, seed: int = 0,
         lead: int = 0) -> list[dict]:
    """``n`` pairs from ``pairs.edit``'s operators, each drawn independently: the first ``lead``
    paraphrases, then each a paraphrase with probability ``paraphrase_share`` (same-scene
    evidence, the cheapest cell to certify), else one edit kind (single, chain or session)
    uniformly. The first m pairs are the same for any n ≥ m, so a larger budget continues the
    same sequence."""
    base = [p.strip() for p in base_prompts if p and p.strip()]
    if not base:
        raise ValueError("no base prompts to derive calibration pairs from")
    rng, out, tries = random.Random(seed), [], 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n + 100:
            raise ValueError(f"only {len(out)} of {n} pairs could be derived from {len(base)} base prompts")
        kind = "paraphrase" if len(out) < lead or rng.random() < paraphrase_share else rng.choice(EDIT_KINDS)
        a = base[rng.randrange(len(base))]
        if kind == "remove_object" and " and " not in a and "; " not in a:
            a = edit(a, "add_object", rng) or a
        b = edit(a, kind, rng, base)
        if b is not None:
            out.append({"a": a, "b": b, "kind": kind, "group": len(out)})
    return out


def pool_from_text(text: str, n: int, paraphrase_share: float = PARAPHRASE_SHARE, seed: int = 0,
                   lead: int = 0) -> list[dict]:
    """``pool`` from a user's prompt list (one per line; ``A || B`` lines are ignored here: a
    cheap calibration draws its pairs itself, independently). Empty: the built-in list."""
    lines = [ln.strip() for ln in (text or "").splitlines()
             if ln.strip() and not ln.startswith("#") and "||" not in ln]
    return pool(lines or BUILTIN_PROMPTS, n, paraphrase_share, seed, lead)

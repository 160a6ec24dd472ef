"""A broad language for tiny-world scenes, in named template families.

``world.caption()`` writes three object templates, three joiners and a few one-word synonyms;
the caption-trained model was trained on that alone and follows people's other phrasings far less
often. :func:`phrase` writes the same scenes the many ways people do. For one green
triangle in the top left falling:

    phrase(scene, random.Random(2))                      # training families
    'a green pyramid starts in the upper left corner and falls towards the bottom'
    phrase(scene, random.Random(3), HELD_OUT_FAMILIES)   # never used in training
    'Here, In This Clip, A Grass Green Triangle Sits In The Upper Left Of The Frame; It Slides
    Towards The Bottom'

and with a red circle in the bottom right moving left beside it (training, then held out):

    'here, crimson circle (bottom-right corner, going left), and a lime coloured wedge near the
    top-left corner, sinking downwards'
    'a small EMERALD PYRAMID is in the upper left-hand corner. it falls while a CRIMSON DISC is
    in the bottom right. it heads left'

A phrasing is built from one family of each **kind**:

- ``clause``  how one object is told: word order and clause form ("there is … that …",
  position first, a participle, the colour as a predicate, a tag list, two sentences, …);
  drawn per object;
- ``joiner``  how two objects' clauses are connected (", while", "as", "; ", ". ", …);
- ``frame``   an optional filler around the whole ("in this clip, …", "we see how …"),
  present in :data:`FRAME_SHARE` of phrasings;
- ``surface`` letter case and final punctuation.

A family is a few templates; the words filling their slots (colour, shape, position, motion,
noun phrase) come from one lexicon shared by every family, multi-word synonyms included
("cherry red", "square tile", "in the upper left-hand corner", "towards the bottom",
"near the top, on the left"). The split holds out whole families -- structure, never words:
every word a held-out family writes also occurs in training phrasings (the denoiser learns
what a word means only from captions it was trained on; tests/test_tinyworld_language.py
checks the coverage). A held-out phrasing draws every kind from :data:`HELD_OUT_FAMILIES`.

Every phrasing describes exactly its scene: :func:`compose` returns the pieces the text was
joined from, each attribute piece tagged with its object and attribute, so a reader can check
each piece apart (the test does, with keyword tables of its own). Phrasings longer than the
text encoder reads (``TEXT_LEN - 1`` MiniLM tokens; it cuts the rest off) are redrawn.

Letter case is invisible to today's encoder (MiniLM's tokenizer is uncased); the surface
families are there so a cased encoder would be tested too. Deterministic from ``rng``.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from . import text as TXT

# ---------------------------------------------------------------- lexicon (shared by all families)
COLOUR_FORMS: Dict[str, Tuple[str, ...]] = {
    "red": ("red", "crimson", "scarlet", "ruby", "cherry red", "bright red"),
    "green": ("green", "emerald", "lime", "lime green", "grass green", "bright green"),
    "blue": ("blue", "azure", "cobalt", "navy", "sky blue", "deep blue"),
    "yellow": ("yellow", "golden", "amber", "lemon", "lemon yellow", "bright yellow"),
}
SHAPE_FORMS: Dict[str, Tuple[str, ...]] = {
    "square": ("square", "box", "block", "cube", "square block", "square tile"),
    "circle": ("circle", "ball", "sphere", "disc", "dot", "round disc"),
    "triangle": ("triangle", "wedge", "pyramid", "triangular tile", "triangular shape"),
}
# position = vertical + horizontal half; {v} an adjective (top/upper), {vn} a noun (the top)
VERTICAL = {"top": ("top", "upper"), "bottom": ("bottom", "lower")}
VERTICAL_NOUN = {"top": "top", "bottom": "bottom"}
POSITION_FORMS = (
    "in the {v} {h}", "in the {v}-{h}", "in the {v} {h} corner", "in the {v}-{h} corner",
    "in the {v} {h}-hand corner", "at the {v} {h}", "at the {v}-{h} corner",
    "in the {v} {h} of the frame", "in the {v} {h} quadrant", "near the {v}-{h} corner",
    # relative to the frame's edges
    "near the {vn}, on the {h}", "on the {h} side, near the {vn}", "in the {v} half, on the {h} side",
)
POSITION_BARE_FORMS = ("{v} {h}", "{v}-{h}", "{v} {h} corner", "{v}-{h} corner")
VERB_FORMS = {  # base: (third person, -ing)
    "move": ("moves", "moving"), "drift": ("drifts", "drifting"), "slide": ("slides", "sliding"),
    "travel": ("travels", "travelling"), "glide": ("glides", "gliding"), "head": ("heads", "heading"),
    "go": ("goes", "going"), "shift": ("shifts", "shifting"), "float": ("floats", "floating"),
    "climb": ("climbs", "climbing"), "rise": ("rises", "rising"), "ascend": ("ascends", "ascending"),
    "fall": ("falls", "falling"), "sink": ("sinks", "sinking"), "drop": ("drops", "dropping"),
    "descend": ("descends", "descending"),
}
_SIDEWAYS = ("move", "drift", "slide", "travel", "glide", "head", "go", "shift")
# motion: (verbs, direction complements, verbs that also say it alone)
MOTION_FORMS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...], Tuple[str, ...]]] = {
    "left": (_SIDEWAYS, ("left", "leftwards", "to the left", "towards the left"), ()),
    "right": (_SIDEWAYS, ("right", "rightwards", "to the right", "towards the right"), ()),
    "up": (("move", "drift", "float", "glide", "climb", "rise"), ("up", "upwards", "towards the top"),
           ("rise", "climb", "ascend")),
    "down": (("move", "drift", "fall", "sink", "drop", "slide"), ("down", "downwards", "towards the bottom"),
             ("fall", "sink", "drop", "descend")),
}
# noun phrases: {a} is the article (a/an by the next word), {c} colour, {s} shape
NOUN_PHRASES = ("{a} {c} {s}", "{a} small {c} {s}", "one {c} {s}", "{a} {c} coloured {s}")
COLOURLESS_NOUN_PHRASES = ("{a} {s}", "{a} small {s}", "one {s}")

# ---------------------------------------------------------------- families
# clause slots: np noun phrase, snp noun phrase without colour, c colour, s shape, p position
# phrase, pb bare position, v motion (third person), ving motion (-ing)
CLAUSES: Dict[str, Tuple[str, ...]] = {
    "clause.subject_first": ("{np} {p} {v}", "{np} {v} {p}"),
    "clause.position_first": ("{p}, {np} {v}", "{p}, there is {np} that {v}"),
    "clause.there_is": ("there is {np} {p} that {v}", "there is {np} {p}, and it {v}",
                        "there's {np} {p} which {v}"),
    "clause.participle": ("{np} {p}, {ving}", "{np} {ving} {p}"),
    "clause.colour_predicate": ("{snp} {p}, {c} in colour, {v}", "{snp} that is {c} {v} {p}"),
    "clause.tags": ("{c} {s}, {pb}, {ving}", "{c} {s} ({pb}, {ving})"),
    "clause.starts": ("{np} starts {p} and {v}", "{np} sits {p} and {v}", "{np}, which begins {p}, {v}"),
    # held out
    "clause.position_first_bare": ("{p} {np} {v}", "{p} {np} is {ving}"),
    "clause.motion_first": ("{ving} {p}: {np}", "{ving}, {np} {p}"),
    "clause.two_sentences": ("{np} is {p}. it {v}", "{np} sits {p}; it {v}"),
    # revision 2 (training)
    "clause.located": ("{np}, located {p}, {v}", "{np} positioned {p} {v}"),
    "clause.appears": ("{np} appears {p} and {v}", "{np} can be seen {p}, {ving}"),
    # calibration only (never trained on, no workload's)
    "clause.which_is": ("{np} which {v} is {p}", "{np} that {v}, {pb}"),
    "clause.colon": ("{np}: {p}, {ving}", "{np}: {pb}, {ving}"),
}
JOINERS: Dict[str, Tuple[str, ...]] = {
    "join.and": ("{a} and {b}", "{a}, and {b}", "{a}, and also {b}"),
    "join.while_comma": ("{a}, while {b}", "{a}, whereas {b}"),
    "join.semicolon": ("{a}; {b}",),
    "join.meanwhile": ("{a}, and meanwhile {b}", "{a}, and at the same time {b}"),
    "join.sentences": ("{a}. {b}",),
    "join.as": ("{a} as {b}",),
    # held out
    "join.while_bare": ("{a} while {b}", "{a} whereas {b}"),
    "join.sentence_meanwhile": ("{a}. meanwhile, {b}", "{a}. at the same time, {b}"),
    "join.also": ("{a}. also, {b}", "{a}; also {b}"),
    # revision 2 (training)
    "join.sentence_adverb": ("{a}. then, {b}", "{a}. in addition, {b}", "{a}. besides, {b}"),
    "join.plus": ("{a}, plus {b}", "{a}, and in addition {b}"),
    # calibration only
    "join.and_then": ("{a} and then {b}", "{a}, and then {b}"),
    "join.comma": ("{a}, {b}",),
}
FRAMES: Dict[str, Tuple[str, ...]] = {
    "frame.clip": ("in this clip, {x}", "in the video, {x}", "{x} in this clip"),
    "frame.we_see": ("we see how {x}", "here, {x}", "scene: {x}"),
    "frame.background": ("on a plain grey background, {x}", "{x}, on a grey background"),
    # held out
    "frame.combined": ("in this video we see how {x}", "here, in this clip, {x}"),
    "frame.background_after": ("{x}. the background is plain grey", "{x} (plain grey background)"),
    # revision 2 (training)
    "frame.shows": ("the clip shows how {x}", "this video: {x}", "watch as {x}"),
    # calibration only
    "frame.video_of": ("a video of how {x}", "video of {x}"),
}
SURFACES = ("surface.lower", "surface.sentence",  # training
            "surface.title", "surface.emphasis")  # held out
KINDS = ("clause", "joiner", "frame", "surface")

HELD_OUT_FAMILIES: Tuple[str, ...] = (
    "clause.position_first_bare", "clause.motion_first", "clause.two_sentences",
    "join.while_bare", "join.sentence_meanwhile", "join.also",
    "frame.combined", "frame.background_after",
    "surface.title", "surface.emphasis",
)
# Revision 2 widened the training language (more clause forms, sentence adverbs and "plus" as
# connectors, more frames) when training on revision 1 stopped closing the gap to the held-out
# families; the held-out families did not change. Revision 1 stays drawable, so the retraining
# recipe reproduces the steps trained on it (scripts/retrain_language.sh).
ADDED_IN_REVISION_2: Tuple[str, ...] = (
    "clause.located", "clause.appears", "join.sentence_adverb", "join.plus", "frame.shows")
# Structures no model is trained on and no workload is written in, for calibration pairs worded
# the way the model was never taught (as people's own prompts are to a real model); the
# fresh-wording workloads keep the held-out families. Outside the training/held-out split.
UNTRAINED_CALIBRATION_FAMILIES: Tuple[str, ...] = (
    "clause.which_is", "clause.colon", "join.and_then", "join.comma", "frame.video_of",
    "surface.lower", "surface.sentence")
# The held-out families split in two: the second of each kind worded into calibration pairs, the
# rest into the fresh-wording workloads served against them, as an operator would calibrate on
# some of people's wording and serve the rest. Neither half is ever trained on.
HELD_OUT_CALIBRATION_HALF: Tuple[str, ...] = (
    "clause.motion_first", "join.sentence_meanwhile", "frame.background_after", "surface.emphasis")
HELD_OUT_SERVING_HALF: Tuple[str, ...] = tuple(
    f for f in HELD_OUT_FAMILIES if f not in HELD_OUT_CALIBRATION_HALF)
_CALIBRATION_ONLY = tuple(f for f in UNTRAINED_CALIBRATION_FAMILIES if not f.startswith("surface."))
ALL_FAMILIES: Tuple[str, ...] = tuple(
    f for f in tuple(CLAUSES) + tuple(JOINERS) + tuple(FRAMES) + SURFACES if f not in _CALIBRATION_ONLY)
TRAIN_FAMILIES: Tuple[str, ...] = tuple(f for f in ALL_FAMILIES if f not in HELD_OUT_FAMILIES)
TRAIN_FAMILIES_REVISION_1: Tuple[str, ...] = tuple(
    f for f in TRAIN_FAMILIES if f not in ADDED_IN_REVISION_2)

FRAME_SHARE = 0.5  # share of phrasings wrapped in a frame
MAX_TOKENS = TXT.TEXT_LEN - 1  # what the encoder reads, [CLS] and [SEP] included
MAX_TRIES = 200


def family_kind(name: str) -> str:
    """'clause.tags' -> 'clause' (the kind a family belongs to)."""
    for kind, table in (("clause", CLAUSES), ("joiner", JOINERS), ("frame", FRAMES)):
        if name in table:
            return kind
    if name in SURFACES:
        return "surface"
    raise ValueError(f"unknown phrasing family {name!r}; families are {', '.join(ALL_FAMILIES)}")


# ---------------------------------------------------------------- composing
Tag = Optional[Tuple[int, str]]  # (object index in the scene, attribute) or None for plain words
Piece = Tuple[str, Tag]


@dataclass(frozen=True)
class Phrasing:
    """A phrasing, the pieces it was joined from (lower case, before the surface family's
    case and final mark) and the family of each kind it used (clause: one per object, in the
    scene's object order; joiner and frame None where absent)."""
    text: str
    pieces: Tuple[Piece, ...]
    families: Dict[str, object] = field(default_factory=dict)


def _fields(template: str) -> List[Tuple[str, Optional[str]]]:
    return [(lit, f) for lit, f, _, _ in string.Formatter().parse(template)]


def _article(next_word: str) -> str:
    return "an" if next_word[:1] in "aeiou" else "a"


class _Writer:
    """Fills one object's clause template, recording a tag for each attribute piece."""

    def __init__(self, obj: dict, index: int, rng: random.Random):
        self.obj, self.i, self.rng = obj, index, rng

    def tagged(self, attribute: str, text: str) -> List[Piece]:
        return [(text, (self.i, attribute))]

    def colour(self) -> List[Piece]:
        return self.tagged("colour", self.rng.choice(COLOUR_FORMS[self.obj["colour"]]))

    def shape(self) -> List[Piece]:
        return self.tagged("shape", self.rng.choice(SHAPE_FORMS[self.obj["shape"]]))

    def _position(self, forms: Sequence[str]) -> List[Piece]:
        vert, horiz = self.obj["position"].split()
        form = self.rng.choice(forms)
        text = form.format(v=self.rng.choice(VERTICAL[vert]), vn=VERTICAL_NOUN[vert], h=horiz)
        return self.tagged("position", text)

    def position(self) -> List[Piece]:
        return self._position(POSITION_FORMS)

    def position_bare(self) -> List[Piece]:
        return self._position(POSITION_BARE_FORMS)

    def _motion(self, form: int) -> List[Piece]:
        verbs, complements, alone = MOTION_FORMS[self.obj["motion"]]
        options = [(v, c) for v in verbs for c in complements] + [(v, None) for v in alone]
        verb, complement = self.rng.choice(options)
        word = VERB_FORMS[verb][form]
        return self.tagged("motion", word if complement is None else f"{word} {complement}")

    def noun_phrase(self, templates: Sequence[str]) -> List[Piece]:
        out: List[Piece] = []
        article_at = None
        for lit, f in _fields(self.rng.choice(templates)):
            if lit:
                out.append((lit, None))
            if f == "a":
                article_at = len(out)
                out.append(("a", None))
            elif f == "c":
                out += self.colour()
            elif f == "s":
                out += self.shape()
        if article_at is not None:
            rest = "".join(t for t, _ in out[article_at + 1:]).lstrip()
            out[article_at] = (_article(rest), None)
        return out

    def slot(self, name: str) -> List[Piece]:
        slots: Dict[str, Callable[[], List[Piece]]] = {
            "np": lambda: self.noun_phrase(NOUN_PHRASES),
            "snp": lambda: self.noun_phrase(COLOURLESS_NOUN_PHRASES),
            "c": self.colour, "s": self.shape, "p": self.position, "pb": self.position_bare,
            "v": lambda: self._motion(0), "ving": lambda: self._motion(1),
        }
        return slots[name]()

    def clause(self, template: str) -> List[Piece]:
        out: List[Piece] = []
        for lit, f in _fields(template):
            if lit:
                out.append((lit, None))
            if f is not None:
                out += self.slot(f)
        return out


# Where a clause may stand. One opening on a bare participle or colour ("moving left, …",
# "crimson ball, top left, …") needs an open context -- the text's start or a break (". ",
# "; ", ": ", ", ") before it: after "while", "as", "and" or "we see how" it would read as
# part of the clause before ("… rises while moving right, a red dot …"). One ending on its
# noun phrase ("…: a red ball") needs a break after it, or "… a red ball and one blue box
# falls" joins the two objects.
_OPEN_STARTS = ("{ving}", "{c}")
_CLOSED_ENDS = ("{np}", "{snp}")


def _opens(before: str) -> bool:
    return before == "" or before.endswith((". ", "; ", ": ", ", "))


def _closes(after: str) -> bool:
    return after == "" or after[0] in ".;,("


def _fits(template: str, before: str, after: str) -> bool:
    return ((_opens(before) or not template.startswith(_OPEN_STARTS))
            and (_closes(after) or not template.endswith(_CLOSED_ENDS)))


def _around(template: str, field_name: str) -> Tuple[str, str]:
    """The literal text just before and just after ``{field_name}`` in a joiner or frame."""
    parts = _fields(template)
    for k, (lit, f) in enumerate(parts):
        if f == field_name:
            return lit, parts[k + 1][0] if k + 1 < len(parts) else ""
    raise ValueError(template)


def _wrap(template: str, parts: Dict[str, List[Piece]]) -> List[Piece]:
    out: List[Piece] = []
    for lit, f in _fields(template):
        if lit:
            out.append((lit, None))
        if f is not None:
            out += parts[f]
    return out


def _cap_first(s: str) -> str:
    return s[:1].upper() + s[1:]


def _surface(family: str, pieces: Sequence[Piece]) -> str:
    if family == "surface.emphasis":  # colour and shape words in capitals
        return "".join(t.upper() if tag and tag[1] in ("colour", "shape") else t for t, tag in pieces)
    text = "".join(t for t, _ in pieces)
    if family == "surface.lower":
        return text
    if family == "surface.sentence":
        text = re.sub(r"([.:] )([a-z])", lambda m: m.group(1) + m.group(2).upper(), _cap_first(text))
        return text if text.endswith(".") else text + "."
    if family == "surface.title":
        return re.sub(r"(?<![\w'])[a-z]", lambda m: m.group(0).upper(), text)
    raise ValueError(family)


def _allowed(families: Iterable[str]) -> Dict[str, List[str]]:
    by_kind: Dict[str, List[str]] = {k: [] for k in KINDS}
    for f in families:
        by_kind[family_kind(f)].append(f)
    for kind in ("clause", "surface"):
        if not by_kind[kind]:
            raise ValueError(f"no {kind} family among {list(families)}: a phrasing needs one "
                             f"(e.g. from TRAIN_FAMILIES or HELD_OUT_FAMILIES)")
    return by_kind


def _draw(scene: dict, rng: random.Random, allowed: Dict[str, List[str]]) -> Phrasing:
    objs = scene["objects"]
    if len(objs) not in (1, 2):
        raise ValueError(f"tiny-world scenes have one or two objects, not {len(objs)}")
    if len(objs) == 2 and not allowed["joiner"]:
        raise ValueError("a two-object scene needs a joiner family")
    order = list(range(len(objs)))
    if len(order) == 2 and rng.random() < 0.5:
        order.reverse()
    # the frame and joiner first: they decide which clause templates fit where
    joiner = joiner_t = frame = None
    frame_t = "{x}"
    if len(objs) == 2:
        joiner = rng.choice(allowed["joiner"])
        joiner_t = rng.choice(JOINERS[joiner])
    if allowed["frame"] and rng.random() < FRAME_SHARE:
        frame = rng.choice(allowed["frame"])
        frame_t = rng.choice(FRAMES[frame])
    x_before, x_after = _around(frame_t, "x")
    if joiner_t is None:
        contexts = [(x_before, x_after)]
    else:
        a_before, between = _around(joiner_t, "a")
        _, b_after = _around(joiner_t, "b")
        contexts = [(x_before + a_before, between), (between, b_after or x_after)]
    clause_of, clauses = {}, []
    for i, (before, after) in zip(order, contexts):
        options = {f: [t for t in CLAUSES[f] if _fits(t, before, after)] for f in allowed["clause"]}
        families = [f for f, ts in options.items() if ts]
        if not families:
            raise ValueError(f"no clause family among {allowed['clause']} fits between {before!r} "
                             f"and {after!r}")
        clause_of[i] = rng.choice(families)
        clauses.append(_Writer(objs[i], i, rng).clause(rng.choice(options[clause_of[i]])))
    pieces = clauses[0] if joiner_t is None else _wrap(joiner_t, {"a": clauses[0], "b": clauses[1]})
    pieces = _wrap(frame_t, {"x": pieces})
    surface = rng.choice(allowed["surface"])
    families = {"clause": tuple(clause_of[i] for i in range(len(objs))), "joiner": joiner,
                "frame": frame, "surface": surface}
    return Phrasing(_surface(surface, pieces), tuple(pieces), families)


def token_count(text: str) -> int:
    return TXT.token_counts([text])[0]


def compose(scene: dict, rng: random.Random, families: Iterable[str] = TRAIN_FAMILIES,
            max_tokens: Optional[int] = MAX_TOKENS,
            count: Callable[[str], int] = token_count) -> Phrasing:
    """A phrasing of ``scene`` from ``families`` (a family of each kind drawn uniformly; the
    clause family per object), with its pieces and families. Draws again while the text is
    longer than ``max_tokens`` by ``count`` (default: MiniLM tokens, the encoder's own
    limit; None: no limit)."""
    allowed = _allowed(list(families))
    for _ in range(MAX_TRIES):
        got = _draw(scene, rng, allowed)
        if max_tokens is None or count(got.text) <= max_tokens:
            return got
    raise ValueError(f"no phrasing of {scene['objects']} within {max_tokens} tokens in {MAX_TRIES} "
                     f"draws from {sorted(families)}: allow shorter families or more tokens")


def phrase(scene: dict, rng: random.Random, families: Iterable[str] = TRAIN_FAMILIES,
           max_tokens: Optional[int] = MAX_TOKENS) -> str:
    """A phrasing of ``scene`` drawn from ``families`` (default: the training families;
    :data:`HELD_OUT_FAMILIES` for evaluation). Deterministic from ``rng``."""
    return compose(scene, rng, families, max_tokens).text


def training_caption(scene: dict, rng: random.Random, broad_share: float,
                     families: Sequence[str] = TRAIN_FAMILIES) -> str:
    """A training caption: with probability ``broad_share`` a phrasing from ``families``
    (the training families of the revision trained on), else ``world.caption``'s own
    paraphrase (so the committed language stays in the mix)."""
    from . import world as WD
    if set(families) & (set(HELD_OUT_FAMILIES) | set(_CALIBRATION_ONLY)):
        raise ValueError("training captions never use the held-out or calibration-only families")
    if rng.random() < broad_share:
        return phrase(scene, rng, families)
    return WD.caption(scene, rng)


# ---------------------------------------------------------------- words the world ignores
# The world has one speed, one shade per colour and no camera: a request that adds these words
# still describes exactly its scene, as people's prompts carry words a model has no use for.
# Neither the training families nor world.caption() writes a speed or a shade.
IGNORED_WORDS: Dict[str, Tuple[str, ...]] = {
    "speed": ("slowly", "quickly", "steadily", "gently", "smoothly"),
    "shade": ("pale", "dark", "light", "soft", "vivid"),
    "filler": ("a short clip:", "please show", "a simple animation:", "high quality, 4k:"),
}
# Words of the same kinds, none shared with IGNORED_WORDS, for calibration pairs: a calibration
# learns what ignored words do to the early states without having seen the workloads' own.
CALIBRATION_IGNORED_WORDS: Dict[str, Tuple[str, ...]] = {
    "speed": ("briskly", "lazily", "rapidly", "calmly"),
    "shade": ("bright", "deep", "muted", "faded"),
    "filler": ("footage:", "in this video,", "watch:", "scene:"),
}


def _in_case_of(word: str, found: str) -> str:
    return word.upper() if found.isupper() else word.title() if found.istitle() else word


def with_ignored_words(phrasing: Phrasing, rng: random.Random, max_tokens: Optional[int] = MAX_TOKENS,
                       count: Callable[[str], int] = token_count,
                       vocabulary: Dict[str, Tuple[str, ...]] = IGNORED_WORDS) -> str:
    """``phrasing``'s text with one to three words the world ignores (from ``vocabulary``),
    of different kinds: a speed after an object's motion, a shade before a one-word colour, a
    filler in front. The tagged pieces stay as they were, so the text still describes exactly
    its scene; a word that would take it past ``max_tokens`` is left out (compose the phrasing
    with room to spare to have every word)."""
    text, wanted, added = phrasing.text, rng.choice((1, 2, 3)), 0
    for kind in rng.sample(list(vocabulary), len(vocabulary)):
        if added == wanted:
            break
        word = rng.choice(vocabulary[kind])
        if kind == "filler":
            new = _in_case_of(word, text.split(" ", 1)[0]) + " " + text
        else:
            attr = "motion" if kind == "speed" else "colour"
            said = [p for p, tag in phrasing.pieces if tag and tag[1] == attr and (attr == "motion" or " " not in p)]
            hit = next((m for p in said for m in [re.search(rf"\b{re.escape(p)}\b", text, re.IGNORECASE)] if m), None)
            if hit is None:
                continue
            new = (text[:hit.end()] + " " + _in_case_of(word, hit.group()) + text[hit.end():] if kind == "speed"
                   else text[:hit.start()] + _in_case_of(word, hit.group()) + " " + text[hit.start():])
        if max_tokens is None or count(new) <= max_tokens:
            text, added = new, added + 1
    return text

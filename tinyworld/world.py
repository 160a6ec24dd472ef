"""The tiny world: short synthetic videos of one or two simple objects, with captions.

Everything here is plain numpy/torch and deterministic from a seed.

A scene is a dict ``{"objects": [obj, ...]}`` where each object is
``{"shape", "colour", "position", "motion"}`` drawn from the small vocabularies below.
Objects sit in one of four position slots (quadrants) and move by ``STEP`` pixels per
frame in one of four directions, so the layout (where the object is and which way it
travels) is a coarse, global property of the whole clip: the denoiser has to commit to it
in its first, high-noise steps. Colour and shape are decided later (fine detail).

Videos are float32 tensors (3, T, H, W) in [0, 1] on a plain grey background.

Sizes: :func:`render` draws the same scene at any number of frames (``frames`` >= 2) and any
square size in pixels that the latent and the Wan patch allow (``size`` a multiple of 4: the
latent halves it and the 1x2x2 patch halves it again), by default the 4-frame 32-px clip
(bit for bit the world's original behaviour). The scene is one continuous picture sampled
at that resolution: positions, shapes and jitter scale with ``size / 32`` (shapes no smaller
than 3/4 of their 32-px size, see :func:`shape_scale`) and the motion spans
the same fraction of the frame over the clip whatever the number of frames (3/16 of the
width, 6 px at 32 px), so more frames are a higher frame rate, not a longer journey.
:data:`SIZES` are the proxy sizes the multi-size model is trained on.
"""
from __future__ import annotations

import random
import re
import string
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

T = 4
H = 32
W = 32
STEP = 2.0  # pixels per frame at the default size (4 frames, 32 px)
SPAN = STEP * (T - 1)  # pixels an object travels over a clip at 32 px, at any number of frames
BACKGROUND = (0.5, 0.5, 0.5)

COLOURS: Dict[str, Tuple[float, float, float]] = {
    "red": (0.92, 0.10, 0.10),
    "green": (0.10, 0.80, 0.15),
    "blue": (0.12, 0.22, 0.95),
    "yellow": (0.95, 0.88, 0.08),
}
SHAPES = ("square", "circle", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
MOTIONS = ("left", "right", "up", "down")
ATTRIBUTES = ("shape", "colour", "position", "motion")

# slot centre (x, y) in pixels
POSITION_CENTRES = {
    "top left": (8.0, 8.0),
    "top right": (24.0, 8.0),
    "bottom left": (8.0, 24.0),
    "bottom right": (24.0, 24.0),
}
MOTION_VECTORS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}

# Synonym sets. The first entry is the canonical word.
COLOUR_WORDS = {
    "red": ["red", "crimson", "scarlet"],
    "green": ["green", "emerald", "lime"],
    "blue": ["blue", "azure", "cobalt"],
    "yellow": ["yellow", "golden", "amber"],
}
SHAPE_WORDS = {
    "square": ["square", "box", "block"],
    "circle": ["circle", "ball", "sphere"],
    "triangle": ["triangle", "wedge", "pyramid"],
}
POSITION_WORDS = {
    "top left": ["in the top left", "in the upper left corner", "at the top left"],
    "top right": ["in the top right", "in the upper right corner", "at the top right"],
    "bottom left": ["in the bottom left", "in the lower left corner", "at the bottom left"],
    "bottom right": ["in the bottom right", "in the lower right corner", "at the bottom right"],
}
MOTION_WORDS = {
    "left": ["moves left", "drifts leftwards", "slides to the left", "travels left"],
    "right": ["moves right", "drifts rightwards", "slides to the right", "travels right"],
    "up": ["moves up", "drifts upwards", "rises", "climbs upwards"],
    "down": ["moves down", "drifts downwards", "sinks", "falls downwards"],
}
OPPOSITE = {
    "left": "right", "right": "left", "up": "down", "down": "up",
    "top left": "top right", "top right": "top left",
    "bottom left": "bottom right", "bottom right": "bottom left",
}

# object phrase templates: c=colour word, s=shape word, p=position phrase, m=motion phrase
OBJECT_TEMPLATES = [
    "a {c} {s} {p} {m}",
    "{p}, a {c} {s} {m}",
    "a {c} {s} {m} {p}",
]
PAIR_JOINERS = ["{a} and {b}", "{a}, while {b}", "{a}; {b}"]


# --------------------------------------------------------------------------- scenes
def random_scene(rng: random.Random, n_objects: int | None = None) -> dict:
    """Draw a scene (attributes only). Two-object scenes use distinct slots and colours."""
    n = n_objects if n_objects is not None else rng.choice((1, 2))
    positions = rng.sample(POSITIONS, n)
    colours = rng.sample(list(COLOURS), n)
    objs = []
    for i in range(n):
        objs.append({
            "shape": rng.choice(SHAPES),
            "colour": colours[i],
            "position": positions[i],
            "motion": rng.choice(MOTIONS),
        })
    return {"objects": objs}


def scene_key(scene: dict) -> tuple:
    return tuple(sorted((o["position"], o["colour"], o["shape"], o["motion"]) for o in scene["objects"]))


# --------------------------------------------------------------------------- sizes
FRAMES = (2, 4, 6, 8)  # the multi-size model's frame counts
PIXELS = (16, 32, 48)  # and square sizes in pixels
SIZES = tuple((f, p) for f in FRAMES for p in PIXELS)


def check_size(frames: int = T, size: int = H) -> Tuple[int, int]:
    """(frames, size) as ints, or ValueError: frames >= 2 (motion needs two frames), size a
    positive multiple of 4 (pixels -> latent halves it, the Wan patch 1x2x2 halves it again)."""
    f, p = int(frames), int(size)
    if f != frames or p != size or f < 2 or p < 4 or p % 4:
        raise ValueError(f"tiny-world size {frames} frames x {size} px: frames must be an integer >= 2 and "
                         f"the size a multiple of 4 px (the latent halves it, the Wan patch 1x2x2 again)")
    return f, p


def parse_sizes(text: str) -> List[Tuple[int, int]]:
    """'2x16,4x32,8x48' (frames x pixels) -> [(2, 16), (4, 32), (8, 48)]; 'all' -> SIZES."""
    if text.strip() == "all":
        return list(SIZES)
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", part)
        if not m:
            raise ValueError(f"size {part!r}: write FRAMESxPIXELS, e.g. 4x32")
        out.append(check_size(int(m.group(1)), int(m.group(2))))
    return out


MIN_SHAPE_SCALE = 0.75  # shapes are never drawn smaller than 3/4 of their 32-px size


def scale_of(size: int = H) -> float:
    """Length scale of a size relative to the default 32 px (positions, motion, jitter)."""
    return size / float(H)


def shape_scale(size: int = H) -> float:
    """Scale of the shapes at a size: ``scale_of(size)``, but at least ``MIN_SHAPE_SCALE`` -- at
    half scale (16 px) a circle of radius 2.3 px and a 4-px square cover the same pixels
    whenever the centre falls on a pixel corner, so no one (checker or model) could tell them
    apart; at 3/4 scale they differ on every frame."""
    return max(scale_of(size), MIN_SHAPE_SCALE)


# --------------------------------------------------------------------------- rendering
def _grid(size: int):
    ax = np.arange(size, dtype=np.float32) + 0.5
    return np.meshgrid(ax, ax, indexing="ij")


_YY, _XX = _grid(H)
_GRIDS = {H: (_YY, _XX)}


def shape_mask(shape: str, cx: float, cy: float, size: int = H) -> np.ndarray:
    """Binary (size, size) mask of a shape centred at (cx, cy) pixels, drawn at
    :func:`shape_scale` of its 32-px dimensions (square 8 px, circle radius 4.6 px, triangle
    base 10 px)."""
    if size not in _GRIDS:
        _GRIDS[size] = _grid(size)
    yy, xx = _GRIDS[size]
    k = shape_scale(size)
    dx = xx - cx
    dy = yy - cy
    if shape == "square":
        return (np.abs(dx) <= 4.0 * k) & (np.abs(dy) <= 4.0 * k)
    if shape == "circle":
        return dx * dx + dy * dy <= (4.6 * k) ** 2
    if shape == "triangle":  # apex up, base 10 px, height 9 px (at 32 px)
        top, bottom = -4.5 * k, 4.5 * k
        inside_y = (dy >= top) & (dy <= bottom)
        half_w = 5.0 * k * (dy - top) / (bottom - top)
        return inside_y & (np.abs(dx) <= half_w)
    raise ValueError(shape)


def object_track(obj: dict, jitter: Tuple[float, float] = (0.0, 0.0), frames: int = T,
                 size: int = H) -> List[Tuple[float, float]]:
    """Centre (x, y) of an object in each frame. ``jitter`` is in pixels of this size. The
    object travels ``SPAN * size / 32`` pixels over the clip, whatever the number of frames."""
    k = scale_of(size)
    cx, cy = POSITION_CENTRES[obj["position"]]
    cx = cx * k + jitter[0]
    cy = cy * k + jitter[1]
    vx, vy = MOTION_VECTORS[obj["motion"]]
    step = SPAN * k / (frames - 1)  # STEP at the default size
    out = []
    for t in range(frames):
        off = (t - (frames - 1) / 2.0) * step
        out.append((cx + vx * off, cy + vy * off))
    return out


def render(scene: dict, seed: int = 0, jitter: bool = True, frames: int = T, size: int = H):
    """Render a scene at ``frames`` x ``size`` x ``size`` (default 4 x 32 x 32).

    Returns (video (3, frames, size, size) float32 in [0, 1], masks (n_objects, frames, size,
    size) bool). ``seed`` only drives the small per-object position jitter (±1 px at 32 px,
    scaled with the size; the same draws at every size).
    """
    frames, size = check_size(frames, size)
    k = scale_of(size)
    rng = np.random.RandomState(seed & 0x7FFFFFFF)
    video = np.empty((3, frames, size, size), dtype=np.float32)
    for c in range(3):
        video[c] = BACKGROUND[c]
    masks = np.zeros((len(scene["objects"]), frames, size, size), dtype=bool)
    for i, obj in enumerate(scene["objects"]):
        jit = tuple(float(v) * k for v in rng.randint(-1, 2, size=2)) if jitter else (0.0, 0.0)
        col = COLOURS[obj["colour"]]
        for t, (cx, cy) in enumerate(object_track(obj, jit, frames, size)):
            m = shape_mask(obj["shape"], cx, cy, size)
            masks[i, t] = m
            for c in range(3):
                video[c, t][m] = col[c]
    return torch.from_numpy(video), torch.from_numpy(masks)


# --------------------------------------------------------------------------- captions
def object_phrase(obj: dict, rng: random.Random | None = None, template: int | None = None,
                  canonical: bool = False) -> str:
    def pick(words):
        return words[0] if canonical or rng is None else rng.choice(words)
    if template is None:
        template = 0 if canonical or rng is None else rng.randrange(len(OBJECT_TEMPLATES))
    return OBJECT_TEMPLATES[template].format(
        c=pick(COLOUR_WORDS[obj["colour"]]), s=pick(SHAPE_WORDS[obj["shape"]]),
        p=pick(POSITION_WORDS[obj["position"]]), m=pick(MOTION_WORDS[obj["motion"]]))


def caption(scene: dict, rng: random.Random | None = None, canonical: bool = False) -> str:
    """Caption a scene. ``canonical`` (or rng=None) gives the template-0, first-synonym caption;
    otherwise a random paraphrase (synonyms, template, joiner, object order)."""
    objs = list(scene["objects"])
    if len(objs) == 1:
        return object_phrase(objs[0], rng, canonical=canonical)
    if not (canonical or rng is None) and rng.random() < 0.5:
        objs = objs[::-1]
    a = object_phrase(objs[0], rng, canonical=canonical)
    b = object_phrase(objs[1], rng, canonical=canonical)
    joiner = PAIR_JOINERS[0] if canonical or rng is None else rng.choice(PAIR_JOINERS)
    return joiner.format(a=a, b=b)


def _lookup(table: Dict[str, List[str]]) -> Dict[str, str]:
    inv = {}
    for k, words in table.items():
        for w in words:
            inv[w] = k
    return inv


# template field -> (attribute, its word or phrase -> value)
_FIELDS = {"c": ("colour", _lookup(COLOUR_WORDS)), "s": ("shape", _lookup(SHAPE_WORDS)),
           "p": ("position", _lookup(POSITION_WORDS)), "m": ("motion", _lookup(MOTION_WORDS))}


def _template_pattern(template: str) -> "re.Pattern[str]":
    """An object template as a regex matching exactly the phrases it can produce."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is not None:
            phrases = sorted(_FIELDS[field][1], key=len, reverse=True)
            parts.append(f"(?P<{field}>{'|'.join(map(re.escape, phrases))})")
    return re.compile("".join(parts))


def _joiner_literals(joiner: str) -> Tuple[str, str, str]:
    """'{a}, while {b}' -> ('', ', while ', '')."""
    pieces = list(string.Formatter().parse(joiner))
    if [f for _, f, _, _ in pieces if f is not None] != ["a", "b"]:
        raise ValueError(f"pair joiner {joiner!r} must name {{a}} then {{b}} once each")
    return pieces[0][0], pieces[1][0], pieces[2][0] if len(pieces) > 2 else ""


_TEMPLATE_PATTERNS = [_template_pattern(t) for t in OBJECT_TEMPLATES]
_JOINER_LITERALS = [_joiner_literals(j) for j in PAIR_JOINERS]
_TOKEN = re.compile(r"[a-z]+|[^a-z\s]")
_CAPTION_TOKENS = set(_TOKEN.findall(" ".join(
    [w for _, inv in _FIELDS.values() for w in inv]
    + [lit for t in OBJECT_TEMPLATES + PAIR_JOINERS for lit, _, _, _ in string.Formatter().parse(t)])))


def _object_readings(phrase: str) -> List[dict]:
    readings = []
    for pattern in _TEMPLATE_PATTERNS:
        m = pattern.fullmatch(phrase)
        if m:
            obj = {_FIELDS[f][0]: _FIELDS[f][1][w] for f, w in m.groupdict().items()}
            readings.append({a: obj[a] for a in ATTRIBUTES})
    return readings


def _caption_readings(text: str) -> List[dict]:
    """Every scene the caption grammar reads ``text`` as: one object phrase, or two around
    one joiner (each occurrence of a joiner's separator tried as the split)."""
    readings = [{"objects": [o]} for o in _object_readings(text)]
    for prefix, sep, suffix in _JOINER_LITERALS:
        if len(text) < len(prefix) + len(suffix) or not (
                text.startswith(prefix) and text.endswith(suffix)):
            continue
        body = text[len(prefix):len(text) - len(suffix)]
        for m in re.finditer(re.escape(sep), body):
            for a in _object_readings(body[:m.start()]):
                for b in _object_readings(body[m.end():]):
                    readings.append({"objects": [a, b]})
    return readings


def parse_caption(text: str) -> dict:
    """The scene of a caption :func:`caption` can write (any template, synonym, joiner, object
    order; any letter case or spacing). Anything else raises ``ValueError``: a reading that
    skipped a word could describe another scene, so none is guessed. The benchmark does not
    call this (workload lines carry their scene); it is for prompts typed by hand."""
    norm = " ".join(text.lower().split())
    readings = _caption_readings(norm)
    scenes = {scene_key(r): r for r in readings}
    if len(scenes) == 1:
        return readings[0]
    if scenes:
        raise ValueError(f"caption {text!r} reads as {len(scenes)} different scenes: "
                         f"{[r['objects'] for r in scenes.values()]}")
    unknown = sorted(set(_TOKEN.findall(norm)) - _CAPTION_TOKENS)
    why = (f"unknown words or marks {unknown}" if unknown
           else "its words are known but not in an order caption() writes")
    joiners = ", ".join(repr(sep) for _, sep, _ in _JOINER_LITERALS)
    raise ValueError(f"cannot read caption {text!r}: {why}. parse_caption accepts only the phrasing "
                     f"tinyworld.world.caption() writes (one object phrase, or two joined by one of "
                     f"{joiners}); pass the scene itself where it is known")


# --------------------------------------------------------------------------- pairs
PAIR_KINDS = ("identical", "compatible_far", "incompatible_close", "partial", "unrelated")


def make_pair(kind: str, seed: int) -> dict:
    """Two related requests of a given kind.

    identical: same caption. compatible_far: same scene, a different paraphrase
    (synonyms/template), textually further apart. incompatible_close: one layout word flipped
    (motion or position left<->right), everything else verbatim. partial: a two-object scene in
    which one object's attributes change while the other stays. unrelated: two independent
    scenes -- what a cache serving many users mostly holds for a request on the same noise.
    Returns {"kind", "a": (scene, caption), "b": (scene, caption), "changed": [object index in
    a's scene that changed] }.
    """
    rng = random.Random(seed)
    if kind == "partial":
        sa = random_scene(rng, 2)
        sb = {"objects": [dict(o) for o in sa["objects"]]}
        i = rng.randrange(2)
        o = sb["objects"][i]
        attr = rng.choice(("colour", "shape", "motion"))
        if attr == "colour":
            o["colour"] = rng.choice([c for c in COLOURS if c not in (sa["objects"][0]["colour"], sa["objects"][1]["colour"])])
        elif attr == "shape":
            o["shape"] = rng.choice([s for s in SHAPES if s != o["shape"]])
        else:
            o["motion"] = rng.choice([m for m in MOTIONS if m != o["motion"]])
        ca = caption(sa, canonical=True)
        cb = caption(sb, canonical=True)
        return {"kind": kind, "a": (sa, ca), "b": (sb, cb), "changed": [i]}
    if kind == "unrelated":
        sa = random_scene(rng)
        sb = random_scene(rng)
        while scene_key(sb) == scene_key(sa):
            sb = random_scene(rng)
        ca, cb = caption(sa, rng), caption(sb, rng)
        return {"kind": kind, "a": (sa, ca), "b": (sb, cb), "changed": list(range(len(sa["objects"])))}
    sa = random_scene(rng, 1)
    if kind == "identical":
        c = caption(sa, random.Random(seed + 1))
        return {"kind": kind, "a": (sa, c), "b": (sa, c), "changed": []}
    if kind == "compatible_far":
        ca = caption(sa, canonical=True)
        for k in range(100):
            cb = caption(sa, random.Random(seed * 1000 + k + 7))
            if cb != ca:
                break
        return {"kind": kind, "a": (sa, ca), "b": (sa, cb), "changed": []}
    if kind == "incompatible_close":
        o = dict(sa["objects"][0])
        if o["motion"] in ("left", "right") or rng.random() < 0.5:
            attr = "motion" if o["motion"] in ("left", "right") else "position"
        else:
            attr = "position"
        sb = {"objects": [dict(o)]}
        sb["objects"][0][attr] = OPPOSITE[o[attr]]
        ca = caption(sa, canonical=True)
        cb = caption(sb, canonical=True)
        return {"kind": kind, "a": (sa, ca), "b": (sb, cb), "changed": [0]}
    raise ValueError(kind)


def sample(seed: int, n_objects: int | None = None, paraphrase: bool = True, frames: int = T, size: int = H):
    """One training/eval example: (video, scene, caption, masks), deterministic from seed."""
    rng = random.Random(seed)
    scene = random_scene(rng, n_objects)
    text = caption(scene, rng) if paraphrase else caption(scene, canonical=True)
    video, masks = render(scene, seed, frames=frames, size=size)
    return video, scene, text, masks


def all_single_scenes() -> List[dict]:
    return [{"objects": [{"shape": s, "colour": c, "position": p, "motion": m}]}
            for s in SHAPES for c in COLOURS for p in POSITIONS for m in MOTIONS]


def vocabulary() -> List[str]:
    words = set()
    for table in (COLOUR_WORDS, SHAPE_WORDS, POSITION_WORDS, MOTION_WORDS):
        for ws in table.values():
            for w in ws:
                words.update(w.split())
    return sorted(words)

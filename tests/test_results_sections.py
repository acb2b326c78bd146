"""Every reference to a section of ``benchmarks/RESULTS.md`` names a heading that exists there.

The project points at RESULTS.md sections from docs, the README, code comments and recipe headers. The forms in
use (and the ones this test also reads):

- ``benchmarks/RESULTS.md`` ("Reliability campaign")  -- quoted heading right after the mention
- benchmarks/RESULTS.md, "Digits-compose"  /  benchmarks/RESULTS.md "Digits-compose"
- RESULTS.md, section "Real model scale"  /  RESULTS.md, section Real model scale  /  RESULTS.md § "X"
- "Reliability campaign" in benchmarks/RESULTS.md  /  the "X" section of RESULTS.md
- RESULTS.md#some-anchor  (GitHub's heading anchors, compared exactly)

A mention may end its line and the heading follow on the next one (wrapped prose and comments). Only
connectors (spaces, backticks, brackets, commas, colons, dashes, "see", "section", "under", "§") may stand
between the mention and the quoted heading, so other quoted words in the same sentence are not taken for
headings. Headings of any level (``#`` to ``####``) outside code fences count; both sides are compared without
markdown (backticks, emphasis), without trailing punctuation, case-insensitively. A reference matches when it is
the whole heading or the heading's title before its first " (", ", ", ": " or " — " (exact), or, when clearly
abbreviated, a prefix of exactly one heading: ending in "…"/"...", or at least two whole words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
SCANNED = [
    "docs/*.md",
    "README.md",
    "benchmarks/*/*.py",
    "diffrl/**/*.py",
    "pipelines/**/*.py",
    "rewards/**/*.py",
    "configs/**/*.yaml",
    "tests/*.py",
]

# ---------------------------------------------------------------------------------------------------------------
# headings of RESULTS.md

_HEADING = re.compile(r"^(#{1,4})[ \t]+(.+?)[ \t]*#*[ \t]*$")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
_TRAILING = ".:;,!?…"


def normalize(text: str) -> str:
    """Heading or reference text without markdown, surrounding quotes and trailing punctuation, case-folded."""
    s = text.replace("\\|", "|").replace("`", "")
    s = re.sub(r"(\*\*|__|\*)", "", s)
    s = re.sub(r"\s+", " ", s).strip().strip("\"“”‘’'").strip()
    s = s.rstrip(_TRAILING + " ")
    while s.endswith("..."):
        s = s[:-3].rstrip(_TRAILING + " ")
    return s.casefold()


def short_title(normalized_heading: str) -> str:
    """The heading's title: the text before its first " (", ", ", ": " or " — " (dates, commits, subtitles)."""
    cut = len(normalized_heading)
    for sep in (" (", ", ", ": ", " — ", " – ", "; "):
        i = normalized_heading.find(sep)
        if 0 < i < cut:
            cut = i
    return normalized_heading[:cut].rstrip(_TRAILING + " ")


def github_slug(text: str) -> str:
    """GitHub's heading anchor (before de-duplication): lower case, punctuation dropped, spaces to hyphens."""
    s = text.replace("`", "").strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def headings_of(markdown: str) -> list[str]:
    """The raw text of every ``#``…``####`` heading outside fenced code blocks."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        m = _HEADING.match(line)
        if m:
            out.append(m.group(2))
    return out


def anchors_of(headings: list[str]) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for h in headings:
        slug = github_slug(h)
        n = seen.get(slug, 0)
        anchors.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return anchors


# ---------------------------------------------------------------------------------------------------------------
# references


@dataclass(frozen=True)
class Ref:
    where: str  # path:line of the mention
    text: str  # the heading as written (or the anchor)
    anchor: bool = False


_MENTION = re.compile(r"(?<![\w/.-])(?:[\w.-]+/)*RESULTS\.md(?:#(?P<anchor>[\w\-%]+(?:\.[\w\-%]+)*))?")
_Q = r"(?:(?<![\"“])[\"“](?![\"”])(?P<{name}>[\w`*][^\"“”\n]*?)[\"”](?![\"”]))"
_KEYWORD = r"(?:(?:see|in|under)\s+)?(?:the\s+)?(?:sections?|headings?|§)\s*"
_KEYWORD_Q = rf"(?:{_KEYWORD}|(?:see|in|under)\s+)"  # before a quoted heading "see"/"in"/"under" alone will do
_CONNECT = r"[\s`,:(\[\])—–-]*"
# forward: mention, connectors, optional "section", one quoted heading (more follow with , / and / or)
_FORWARD = re.compile(rf"^{_CONNECT}{_KEYWORD_Q}?{_Q.format(name='q')}")
_MORE = re.compile(rf"^\s*(?:,|and|or|&)\s*{_KEYWORD_Q}?{_Q.format(name='q')}")
# forward, unquoted, only after a section keyword: "RESULTS.md, section Real model scale."
_BARE = re.compile(rf"^{_CONNECT}{_KEYWORD}(?P<bare>[A-Za-z0-9][^;,)\]\"“\n]*?)\s*(?=\.(?:\s|$)|[;,)\]]|$)")
# backward: '"Heading" in RESULTS.md', 'the "Heading" section of `RESULTS.md`'
_BACKWARD = re.compile(rf"{_Q.format(name='q')}\s*(?:sections?\s+|headings?\s+)?(?:in|of)\s+(?:the\s+)?[`(]*$")


def _continuation(lines: list[str], i: int, count: int = 2) -> str:
    """The next lines of a file as one run of prose (indent, comment and docstring markers dropped)."""
    parts = []
    for line in lines[i + 1 : i + 1 + count]:
        parts.append(re.sub(r"^\s*(?:#+\s|//\s*|\*\s|>\s*|\"\"\"|''')?\s*", "", line))
    return " " + " ".join(parts) if parts else ""


def references_in(text: str, where: str) -> list[Ref]:
    """The RESULTS.md section references in one file's text (``where`` is its path, for messages)."""
    lines = text.splitlines()
    refs: list[Ref] = []
    for i, line in enumerate(lines):
        for m in _MENTION.finditer(line):
            loc = f"{where}:{i + 1}"
            if m.group("anchor"):
                refs.append(Ref(loc, m.group("anchor"), anchor=True))
            after = line[m.end() :] + _continuation(lines, i)
            f = _FORWARD.match(after)
            if f:
                refs.append(Ref(loc, f.group("q")))
                rest = after[f.end() :]
                while (more := _MORE.match(rest)) is not None:
                    refs.append(Ref(loc, more.group("q")))
                    rest = rest[more.end() :]
            else:
                b = _BARE.match(after)
                if b:
                    refs.append(Ref(loc, b.group("bare")))
            before = (lines[i - 1].strip() + " " if i > 0 else "") + line[: m.start()]
            back = _BACKWARD.search(before)
            if back:
                refs.append(Ref(loc, back.group("q")))
    return refs


def scanned_files() -> list[Path]:
    me = Path(__file__).resolve()
    files = set()
    for pattern in SCANNED:
        files.update(p for p in REPO.glob(pattern) if p.is_file() and p.resolve() != me)
    return sorted(files)


def all_references() -> list[Ref]:
    refs = []
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if "RESULTS.md" in text:
            refs += references_in(text, str(path.relative_to(REPO)))
    return refs


# ---------------------------------------------------------------------------------------------------------------
# matching


def resolve(ref: Ref, headings: list[str]) -> str | None:
    """None when the reference names an existing heading, else why not."""
    if ref.anchor:
        return None if ref.text.lower() in anchors_of(headings) else f"no heading has the anchor #{ref.text}"
    want = normalize(ref.text)
    if not want:
        return "empty heading"
    full = [normalize(h) for h in headings]
    if any(want == h or want == short_title(h) for h in full):
        return None
    raw = re.sub(r"\s+", " ", ref.text).strip().rstrip("\"”'’ )").rstrip()
    ellipsis = raw.endswith("…") or raw.endswith("...")
    if ellipsis:
        hits = [h for h in full if h.startswith(want)]
    elif len(want.split()) >= 2:
        hits = [h for h in full if h.startswith(want) and (len(h) == len(want) or not h[len(want)].isalnum())]
    else:
        hits = []
    if len(hits) == 1:
        return None
    if len(hits) > 1:
        return f"abbreviation matches {len(hits)} headings: " + " | ".join(hits)
    return "no such heading"


# ---------------------------------------------------------------------------------------------------------------
# tests


def test_every_results_reference_names_an_existing_heading():
    headings = headings_of(RESULTS.read_text(encoding="utf-8"))
    refs = all_references()
    assert refs, "no RESULTS.md section reference found at all: the parser no longer reads the project's forms"
    dangling = [(r, why) for r in refs if (why := resolve(r, headings)) is not None]
    assert not dangling, "references to benchmarks/RESULTS.md sections that do not exist:\n" + "\n".join(
        f"  {r.where}: {'#' if r.anchor else ''}{r.text!r} ({why})" for r, why in dangling
    )


_HEADS = [
    "Measured results",
    "Real model scale on one H200 (issue 16, `benchmarks/gpu_scale.py`; 2026-12-03, commit 85a726d code)",
    "Reliability campaign (issue 17, 2026-12-03, work machine, 2 cores)",
    "Digits-compose, GenEval's table at miniature scale (issue 20; 2026-12-04, work machine, 2 cores)",
    "GPU speed at SD3.5-Medium scale (issue 8, `benchmarks/gpu_speed.py`)",
    "On one H200 (2026-12-03, torch 2.11.0+cu130)",
    "On one H200: actor and replica as two processes on one GPU (2026-12-04, commit 6836d93)",
]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('the measured table is in `benchmarks/RESULTS.md` ("Reliability campaign").', ["Reliability campaign"]),
        ('# Measured: benchmarks/RESULTS.md, "Digits-compose".', ["Digits-compose"]),
        ('# no better, benchmarks/RESULTS.md "Digits-compose").', ["Digits-compose"]),
        ('(measured on one H200, `benchmarks/RESULTS.md`, "Real model scale"):', ["Real model scale"]),
        ("see RESULTS.md, section “GPU speed at SD3.5-Medium scale”.", ["GPU speed at SD3.5-Medium scale"]),
        ("see RESULTS.md, section Real model scale.", ["Real model scale"]),
        ('RESULTS.md § "Reliability campaign"', ["Reliability campaign"]),
        ('benchmarks/RESULTS.md, under "Reliability campaign"', ["Reliability campaign"]),
        ("the numbers in RESULTS.md in the table below", []),
        ('the "Reliability campaign" section of `benchmarks/RESULTS.md`', ["Reliability campaign"]),
        ('RESULTS.md ("Digits-compose", "Real model scale")', ["Digits-compose", "Real model scale"]),
        ("numbers in `benchmarks/RESULTS.md`). `model.compile_mode=reduce-overhead` replays", []),
        ('the recipe: +50 points, RESULTS.md)."""', []),
        ('open("benchmarks/RESULTS.md", "r")', []),
        ("# low-noise steps lowered gold, benchmarks/RESULTS.md], 10 sampling steps", []),
        ('(benchmarks/RESULTS.md) uses "executed" FLOPs', []),
    ],
)
def test_reference_forms(line, expected):
    assert [r.text for r in references_in(line, "x")] == expected


def test_reference_wrapped_onto_the_next_line():
    text = 'the measured table is in\n`benchmarks/RESULTS.md`\n("Reliability campaign").\n'
    assert [(r.where, r.text) for r in references_in(text, "x")] == [("x:2", "Reliability campaign")]
    comment = "# Measured: benchmarks/RESULTS.md,\n# \"Digits-compose\".\n"
    assert [r.text for r in references_in(comment, "x")] == ["Digits-compose"]


def test_anchor_reference():
    refs = references_in("[table](../benchmarks/RESULTS.md#reliability-campaign-issue-17-2026-12-03-work-machine-2-cores)", "x")
    assert [(r.text, r.anchor) for r in refs] == [("reliability-campaign-issue-17-2026-12-03-work-machine-2-cores", True)]
    assert resolve(refs[0], _HEADS) is None
    assert resolve(Ref("x", "reliability-campaign", anchor=True), _HEADS) is not None


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("Reliability campaign", True),  # the title before " ("
        ("reliability campaign.", True),  # case and trailing punctuation
        ("Digits-compose", True),  # the title before ", "
        ("Real model scale", True),  # abbreviated: two or more whole words, one heading
        ("Real model sc", False),  # not at a word boundary
        ("Real model sc…", True),  # an explicit ellipsis
        ("**Measured results**", True),
        ("Reliability", False),  # one word, not the title: not clearly abbreviated
        ("On one H200", True),  # exact title of one heading wins over the longer one
        ("Rollout replicas", False),
        ("CI and the newcomer path", False),
    ],
)
def test_heading_matching(text, ok):
    assert (resolve(Ref("x", text), _HEADS) is None) == ok


def test_headings_skip_code_fences():
    md = "# Top\n\n```\n# not a heading\n```\n\n#### Deep one (x)\n##### too deep\n"
    assert headings_of(md) == ["Top", "Deep one (x)"]

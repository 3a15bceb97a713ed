"""README.md and docs/ say what is true of the product now: no references to this project's issues, and none of
the words that narrate work on the project (sessions, rounds, "previously", "no longer", "as before", a dated
measurement in prose). What changed, and when, is CHANGELOG.md's; it is the one Markdown file not read here.

The tables between ``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->`` in docs/benchmarks.md are
written by the benchmark harness and say when they were measured: their dates are the run they show, not
history, and are not read for dates. Links to other projects' issues (``PrefectHQ/prefect#13004``) are fine.

The code's comments and docstrings (flows/, tasks/, ddpflow/, training/, bench/ and the tests' shared helpers)
name a file older than a feature by the version that brought it (``PREPARE_VERSION 6``) or by what it lacks ("a
model.pt without ``inputs``"), never as "from before" or "the earlier mlp" (``CODE_NARRATION``). "An earlier
run" of the same command, "any more" and "no longer" say what the product does, and stay."""

from __future__ import annotations

import re
from pathlib import Path

from source_text import comments_and_docstrings

REPO = Path(__file__).resolve().parents[2]
HISTORY = REPO / "CHANGELOG.md"

# A reference to one of this project's issues or pull requests: "issue 36", "issues 12 and 36", "(#36)", "PR 7".
# A number after "#" is someone else's only when the repository is named right before it (owner/name#123).
ISSUE_REFERENCES = (
    r"\bissues?\s+#?\d+",
    r"\b(?:PR|pull request)\s*#?\d+",
    r"(?<![\w/.#-])#\d+\b",
)

# Words that tell the story of the work, not the product. A precise list: "session" alone also names a process
# session (setsid) and pytest's, which stay.
NARRATION = (
    r"\bsessions?[ -]\d+",  # "session 7", "session-3 run"
    r"\b(?:this|that|each|an earlier|a later|earlier|later|previous|next|last|one|the last) sessions?\b",
    r"\bproject's sessions\b",
    r"\b(?:this|last|next|previous|that|one) round\b",
    r"\bpreviously\b",
    r"\bused to (?:be|take|say|fail|print|run|read|write|keep|start|give|show|cost)\b",
    r"\bno longer\b",
    r"\bany ?more\b",
    r"\b(?:was|were|has been|have been) (?:changed|retired|reverted|removed|renamed|replaced|fixed|raised)\b",
    r"\bnow (?:refused|rejected|accepted|fixed|removed|added|supported|the default|default|fails|passes)\b",
    r"\b(?:before|since|after) (?:these|this|that|the) changes?\b",
    r"\bbefore (?:those|this session|that session|it was)\b",
    r"\b(?:as|than) before\b",
    r"\b(?:up|down) from\b",
    r"\b(?:was|were) \d",
    r"\bearlier (?:runs?|readings?|measurements?|figures?|versions?|ones?|tables?|default|defaults|seeds)\b",
    r"\(earlier[:,]",
    r"\buntil (?:now|then|recently)\b",
    r"(?<!least )(?<!most )\b(?:recently|lately)\b",  # "least recently used" is a cache's rule, not history
    r"\bthe old (?:default|rule|behaviou?r|figure|value|way|code)\b",
)

# Words that narrate the code's history in a comment or docstring.
CODE_NARRATION = (
    r"\b(?:from|as) before\b",
    r"\bbefore (?:imputation|robust scaling|typed inputs|objectives)\b",
    r"\bolder (?:manifests?|datasets?|files|model\.pt|callers|ddpflow)\b",
    r"\bthe earlier (?:mlp|model|rule|version)\b",
    r"\bthe old (?:default|rule|behaviou?r|way|code)\b",
    r"\bused to (?:be|take|say|fail|print|run|read|write|keep|start|give|show|cost)\b",
    r"\b(?:was|were) \d",
)

DATE = r"\b20\d\d-\d\d-\d\d\b"  # a measurement's date in prose
# A measurement's hour in prose ("the run of 22:33 UTC"); a schedule's ("at 02:00 UTC") stays.
CLOCK = r"\b(?:run|runs|reading|measured|taken|started|made)\b[^.]{0,30}?\b\d\d:\d\d(?::\d\d)? UTC\b"
GENERATED = re.compile(r"<!-- bench:([\w-]+):begin -->.*?<!-- bench:\1:end -->", re.DOTALL)


def product_docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose(path: Path) -> str:
    """The file without the benchmark harness's generated tables (kept as blank lines: line numbers stay)."""
    return GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())


def without_code(text: str) -> str:
    """The text with its code (fenced blocks, inline spans) blanked, line numbers kept: a date in code is an
    example value (`2024-05-31` as a time input), not when something was measured."""
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.DOTALL)
    return re.sub(r"`[^`\n]*`", "``", text)


def passages(text: str, patterns: tuple[str, ...]) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in patterns:
            match = re.search(pattern, line, flags=re.IGNORECASE)
            if match:
                found.append((number, match.group(0)))
    return found


def report(found: dict[str, list[tuple[int, str]]]) -> str:
    return "\n".join(f"{name}:{number}: {words!r}" for name, hits in found.items() for number, words in hits)


def test_no_doc_refers_to_this_projects_issues():
    found = {path.name: passages(path.read_text(), ISSUE_REFERENCES) for path in product_docs()}
    found = {name: hits for name, hits in found.items() if hits}
    assert not found, f"{sum(map(len, found.values()))} issue references:\n{report(found)}"


def test_no_doc_narrates_work_on_the_project_or_dates_a_past_measurement_in_prose():
    found = {
        path.name: passages(prose(path), (*NARRATION, CLOCK)) + passages(without_code(prose(path)), (DATE,))
        for path in product_docs()
    }
    found = {name: hits for name, hits in found.items() if hits}
    assert not found, f"{sum(map(len, found.values()))} narrating passages:\n{report(found)}"


def test_the_changelog_holds_the_history_and_every_doc_in_docs_is_linked_from_the_readme():
    assert HISTORY.is_file() and "## [Unreleased]" in HISTORY.read_text()
    readme = (REPO / "README.md").read_text()
    unlinked = [path.name for path in sorted((REPO / "docs").glob("*.md")) if f"](docs/{path.name})" not in readme]
    assert unlinked == [], f"README's links miss {unlinked}"
    assert len(readme.splitlines()) < 200, "README: quick start, usage by task and links; reference lives in docs/"


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchor of each heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    headings = re.findall(r"^#+\s+(.*)$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_link_between_the_docs_reaches_its_file_and_section():
    broken = []
    for doc in [*product_docs(), HISTORY]:
        for target, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = (doc.parent / target).resolve() if target else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} does not exist")
            elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
                broken.append(f"{doc.name}: {target}#{anchor} names no heading")
    assert broken == []


def test_the_checks_catch_what_they_are_for():
    """Each pattern on a passage of the kind it is for, and none on the product's own vocabulary."""
    narrated = (
        "Reading (session 7): 0.983.",
        "the session-3 run",
        "before these changes the run took 9 s",
        "the gate was 95",
        "a NaN is now refused",
        "measured earlier runs at 1.2",
        "as before, the default stays",
        "it no longer resumes",
        "this round measured it",
        "(earlier: worst +0.027)",
        "no GPU was lent to this project's sessions",
    )
    for text in narrated:
        assert passages(text, NARRATION), text
    assert passages("the run of 2026-12-01", (DATE,)) and passages("the full run of 22:33 UTC", (CLOCK,))
    assert not passages(without_code("ISO strings (`2024-05-31`) or `val: 2024-06-01`"), (DATE,))
    assert not passages("nightly at 02:00 UTC", (CLOCK,))
    for text in ("the experiments that found it (issue 36)", "see #36", "PR 12 fixed it"):
        assert passages(text, ISSUE_REFERENCES), text
    product = (
        "each process in its own session, from argument lists",
        "one Prefect test harness per session",
        "see PrefectHQ/prefect#13004 and PrefectHQ/prefect#20979",
        "the weights of an earlier epoch",
        "the train split is used to fit the encoders",
        "## Heading",
        "before the run starts",
        "evicting the least recently used shard",
    )
    for text in product:
        assert not passages(text, (*NARRATION, *ISSUE_REFERENCES)), text


def test_the_settings_that_define_a_training_are_the_codes():
    """docs/concepts.md's training identity names every field `TrainConfig.weight_fields()` holds."""
    from training.core.config import TrainConfig

    text = (REPO / "docs" / "concepts.md").read_text()
    paragraph = text[text.index("**Training identity.**") :].split("\n\n")[0]
    missing = [name for name in TrainConfig.weight_fields() if f"`{name}`" not in paragraph]
    assert missing == [], f"docs/concepts.md's training identity lacks {missing}"


def test_no_product_comment_narrates_the_codes_history():
    helpers = [*(REPO / "tests").glob("*.py"), *(REPO / "tests" / "ranks").glob("*.py")]  # tests' shared code
    code = [
        path
        for package in ("flows", "tasks", "ddpflow", "training", "bench")
        for path in (REPO / package).rglob("*.py")
    ]
    found = {
        str(path.relative_to(REPO)): hits
        for path in sorted([*code, *helpers])
        if (hits := passages(comments_and_docstrings(path), CODE_NARRATION))
    }
    assert not found, f"name the version or what the file lacks instead:\n{report(found)}"
    for text in ("a dataset from before imputation", "the earlier mlp's", "None in older manifests", "(was 24)"):
        assert passages(text, CODE_NARRATION), text
    for text in ("an earlier run left them", "None before PREPARE_VERSION 6", "nothing runs any more"):
        assert not passages(text, CODE_NARRATION), text


def test_no_comment_or_docstring_refers_to_this_projects_issues():
    """The code's comments and docstrings, the tests' included, say what the code does, not which issue asked for it
    (this file's own patterns excepted)."""
    here = Path(__file__).resolve()
    code = [
        path
        for package in ("flows", "tasks", "ddpflow", "training", "bench", "examples", "tests")
        for path in (REPO / package).rglob("*.py")
        if path.resolve() != here
    ]
    found = {
        str(path.relative_to(REPO)): hits
        for path in sorted(code)
        if (hits := passages(comments_and_docstrings(path), ISSUE_REFERENCES))
    }
    assert not found, f"{sum(map(len, found.values()))} issue references:\n{report(found)}"

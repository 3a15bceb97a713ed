"""Every shell command of README.md runs as written on a fresh copy of the checkout, in order, as one person's
shell would run them (tests/documented_commands.py says what the test changes: ports, make's stamp, the session's
Prefect harness until the stack is up). One run of the whole README for the module; the tests read it.

What it shows beyond "exit 0": the demo registers the model the README serves (`ddpflow serve ddpflow-demo`), the
served model answers the README's curl, the shipped configs/score.yaml scores what the checkout holds, `ddpflow
stack up`'s export line reaches the stack from the shell (`prefect deployment run` as written), and nothing the
stack runs by itself on a fresh checkout fails."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.documented_commands import REPO, DocShell, doc_run, fresh_checkout, shell_blocks

# torchrun and server: the demo's ranks, the stack, ddpflow serve. The whole doc runs in the module's fixture:
# minutes of launches (a stack, trainings), counted in the first test's timeout, so the suite's 600 s is raised.
pytestmark = [pytest.mark.torchrun, pytest.mark.server, pytest.mark.timeout(1500)]

FAILED_STATES = {"FAILED", "CRASHED"}


def stack_runs(shell: DocShell) -> None:
    """Right after the README's deployment run, while the stack is up: every flow run on the stack, and the
    deployments it holds (read through the API the shell's `prefect` reached)."""
    api = shell.env["PREFECT_API_URL"]
    runs = httpx.post(f"{api}/flow_runs/filter", json={}, timeout=30).raise_for_status().json()
    deployments = httpx.post(f"{api}/deployments/filter", json={}, timeout=30).raise_for_status().json()
    shell.after_results["stack"] = {"runs": runs, "deployments": deployments}


@pytest.fixture(scope="module")
def readme(tmp_path_factory, prefect_harness, _migrated_mlflow_db) -> Iterator[DocShell]:
    checkout = fresh_checkout(tmp_path_factory.mktemp("readme-checkout"))
    after = {"prefect deployment run": stack_runs}
    with doc_run(REPO / "README.md", checkout, _migrated_mlflow_db, prefect_harness, after) as shell:
        yield shell


def test_every_command_of_the_readme_runs_green_on_a_fresh_checkout(readme: DocShell):
    assert readme.failures() == [], readme.report()
    typed = readme.typed()
    blocks = shell_blocks(REPO / "README.md")
    expected = [command for block in blocks if block.not_run is None for command in block.commands]
    assert sorted(typed) == sorted(expected), readme.report()
    assert [block.not_run for block in readme.skipped] == [
        "tests/flows/test_scripts.py runs this example and serves its model",
        "it runs the test suite, which holds the docs test itself",
    ], "a block the test does not run says why"
    print(readme.report())


def test_the_demo_registers_the_model_the_readme_serves_and_the_served_model_answers_its_curl(readme: DocShell):
    demo = readme.output_of("make demo")
    assert re.search(r"model_name: ddpflow-demo\n\s+model_version: 1\n\s+decision: promoted", demo), demo[-3000:]
    two_ranks = readme.output_of("ddpflow run --config configs/demo.yaml --set train.nproc_per_node=2")
    assert "Launching 2 rank(s) x 1 node(s) (gloo)" in two_ranks, "DDP on 2 CPU ranks"
    assert "Launching 1 rank(s) x 1 node(s) (gloo)" in demo, "the demo: auto is one rank on a machine without GPUs"
    status, output = readme.stopped_one("ddpflow serve")
    assert "Serving ddpflow-demo v" in output and "(models:/ddpflow-demo@champion)" in output, output[-3000:]
    assert status == 130 and "left:" not in output, "Ctrl-C stops the server and everything it started"
    answer = json.loads(readme.output_of("curl -s http://127.0.0.1:5001/invocations"))
    assert answer == {"predictions": [3]}, answer  # the README says so


def test_the_shipped_score_config_scores_the_rows_the_checkout_holds(readme: DocShell):
    output = readme.checkout / "data" / "scores" / "today"
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["model"]["name"] == "ddpflow-demo" and manifest["model"]["uri"] == "models:/ddpflow-demo@champion"
    assert manifest["rows"] == manifest["scored"] == 1000 and manifest["output_kind"] == "probabilities"
    assert manifest["source"]["url"] == str(readme.checkout / "data" / "today")


def test_the_shell_reaches_the_stack_and_nothing_the_stack_runs_by_itself_fails(readme: DocShell):
    """`eval "$(ddpflow stack env)"` then `prefect deployment run 'train-pipeline/manual' --watch` as written: the
    run completes on the stack's server, which holds prefect.yaml's eight deployments; no flow run on the fresh
    stack (the manual run and whatever its schedules and triggers started: the new champion's scoring, the watch)
    failed or crashed."""
    assert "Flow run finished successfully in 'Completed'" in readme.output_of("prefect deployment run"), (
        readme.output_of("prefect deployment run")[-3000:]
    )
    stack = readme.after_results["stack"]
    names = {f"{d['name']}" for d in stack["deployments"]}
    assert len(names) == 8 and {"manual", "nightly", "score-nightly", "score-on-new-champion"} <= names, names
    failed = {run["name"]: (run["state_type"], (run["state"] or {}).get("message")) for run in stack["runs"]
              if run["state_type"] in FAILED_STATES}  # fmt: skip
    assert failed == {}, failed
    assert "stopped: ['worker', 'mlflow', 'prefect-server']" in readme.output_of("ddpflow stack down")


def test_the_readme_is_short_and_every_ddpflow_command_it_names_parses(readme: DocShell):
    """Inline commands (the table of other commands) are not run, but each `ddpflow ...` one parses with the
    real parser and names files the checkout holds."""
    from flows.cli import build_parser

    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 200
    parser = build_parser()
    for inline in re.findall(r"`(ddpflow [^`]+)`", text):
        words = [word for word in inline.split()[1:] if word not in ("…", "...")]
        words = [{"CONFIG": "configs/demo.yaml", "RUN_ID": "0" * 32}.get(word, word) for word in words]
        if words[0] in ("serve", "stack") or "NAME" in inline:
            continue  # ran above (serve, stack); NAME@alias is a pattern
        parser.parse_args(words)
        for word in words:
            if word.startswith("configs/"):
                assert (readme.checkout / word).is_file(), inline

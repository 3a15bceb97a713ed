"""docs/walkthrough.md, start to finish: every shell command runs as written on a fresh copy of the checkout, in
order, in one person's shell (tests/documented_commands.py says what the test changes: ports, the session's
Prefect harness until the stack is up). One run for the module; the tests read it.

What it shows beyond "exit 0": prepare names the string columns it left out and why, then takes them; the run
registers `churn`, which `ddpflow serve churn` serves and which answers a curl of raw rows (strings, an int64,
a null); `ddpflow score` scores the new file keeping its ids; the user's own deployment file makes a nightly
deployment without touching prefect.yaml, and its run through the worker completes (skipped: the table has not
changed since the run that trained the champion)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator

import pandas as pd
import pytest
from mlflow import MlflowClient

from tests.documented_commands import REPO, DocShell, doc_run, fresh_checkout, shell_blocks

# torchrun and server: the run's ranks, the stack, ddpflow serve. The whole doc runs in the module's fixture: minutes of
# launches (a stack, trainings), counted in the first test's timeout, so the suite's 600 s per test is raised.
pytestmark = [pytest.mark.torchrun, pytest.mark.server, pytest.mark.timeout(1500)]

WALKTHROUGH = REPO / "docs" / "walkthrough.md"


def deployment_of_the_user(shell: DocShell) -> None:
    """Right after `prefect deploy --prefect-file`, through the shell's own `prefect`: the deployment as stored."""
    shown = subprocess.run(
        ["bash", "-c", "prefect deployment inspect 'train-pipeline/churn-nightly'"], cwd=shell.cwd, env=shell.env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    shell.after_results["inspect"] = shown.stdout + shown.stderr


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory, prefect_harness, _migrated_mlflow_db) -> Iterator[DocShell]:
    checkout = fresh_checkout(tmp_path_factory.mktemp("walkthrough-checkout"))
    after = {"prefect --no-prompt deploy --prefect-file": deployment_of_the_user}
    with doc_run(WALKTHROUGH, checkout, _migrated_mlflow_db, prefect_harness, after) as shell:
        yield shell


def test_every_command_of_the_walkthrough_runs_green_on_a_fresh_checkout(walkthrough: DocShell):
    assert walkthrough.failures() == [], walkthrough.report()
    typed = walkthrough.typed()
    expected = [command for block in shell_blocks(WALKTHROUGH) for command in block.commands]
    assert sorted(typed) == sorted(expected) and walkthrough.skipped == [], walkthrough.report()
    print(walkthrough.report())


def test_the_table_has_int64_ids_strings_and_nulls_and_prepare_says_what_it_left_out_and_why(walkthrough: DocShell):
    table = pd.read_parquet(walkthrough.checkout / "data" / "churn" / "customers.parquet", dtype_backend="pyarrow")
    assert str(table["customer_id"].dtype) == "int64[pyarrow]" and str(table["country"].dtype).startswith("string")
    assert table["tenure_days"].isna().any() and table["monthly_spend"].isna().any()
    first, second = [ran.output for ran in walkthrough.ran if ran.typed.startswith("ddpflow prepare")]
    assert "left_out: [{'column': 'country', 'type': 'string', 'suggest': 'categorical'" in first, first[-2000:]
    assert "'column': 'plan', 'type': 'string', 'suggest': 'categorical'" in first
    assert "null_rates: {'tenure_days':" in first and "'monthly_spend':" in first
    assert "left_out: []" in second and "'country': 'categorical'" in second, second[-2000:]


def test_the_run_registers_churn_which_serve_serves_and_a_curl_of_raw_rows_scores(walkthrough: DocShell):
    run = walkthrough.output_of("ddpflow run --config configs/churn.yaml")
    assert "model_name: churn" in run and "decision: promoted" in run
    assert re.search(r"baselines: test_\w+ [\d.]+ · reference [\d.]+ · guessing", run), run[-3000:]
    status, output = walkthrough.stopped_one("ddpflow serve")
    assert "Serving churn v1 (models:/churn@champion)" in output and status == 130 and "left:" not in output
    answer = json.loads(walkthrough.output_of("curl -s http://127.0.0.1:5001/invocations"))
    assert len(answer["predictions"]) == 2 and all(isinstance(p, bool) for p in answer["predictions"]), answer


def test_the_new_file_is_scored_keeping_its_ids(walkthrough: DocShell):
    scores = pd.read_parquet(sorted((walkthrough.checkout / "data" / "scores" / "churn").glob("part-*.parquet")))
    new = pd.read_parquet(walkthrough.checkout / "data" / "churn" / "new-customers.parquet")
    assert scores["customer_id"].tolist() == new["customer_id"].tolist()  # every row once, in order
    assert {"prediction", "probability_False", "probability_True"} <= set(scores.columns)
    assert "customer_id" in walkthrough.output_of("python -c")


def test_a_nightly_deployment_of_ones_own_config_without_editing_prefect_yaml(walkthrough: DocShell):
    inspected = walkthrough.after_results["inspect"]
    assert "'cron': '30 1 * * *'" in inspected and "'config_file': 'configs/churn.yaml'" in inspected, inspected
    assert str(walkthrough.checkout) in inspected  # the pull step: the checkout the worker runs the flow in
    assert (walkthrough.checkout / "prefect.yaml").read_text() == (REPO / "prefect.yaml").read_text()
    ran = walkthrough.output_of("prefect deployment run 'train-pipeline/churn-nightly' --watch")
    assert "Flow run finished successfully in 'Completed'" in ran, ran[-3000:]
    # Through the worker, in the checkout, on the same store: the table is unchanged since step 3, so it skipped.
    store = MlflowClient(f"sqlite:///{walkthrough.checkout / 'mlflow.db'}")
    (skipped,) = store.search_runs(
        [store.get_experiment_by_name("ddpflow").experiment_id], "tags.`ddpflow.skipped` = 'true'"
    )
    assert skipped.data.tags["registry.decision"] == "skipped" and skipped.data.tags["prefect.deployment"]
    status = walkthrough.output_of("ddpflow stack status")  # step 7: where the two UIs are, and that they answer
    assert "prefect_healthy: True" in status and "mlflow_healthy: True" in status, status
    assert f"http://127.0.0.1:{walkthrough.ports['prefect']}" in status
    assert "stopped: ['worker', 'mlflow', 'prefect-server']" in walkthrough.output_of("ddpflow stack down")

"""allennlp 2.10.1's own tests/modules/elmo_test.py (tests/client/allennlp210/, vendored with only the import of
`Elmo` changed to elmo_client.elmo) run in the allennlp environment against a served fixture model: every test
passes but test_elmo_with_module (`module=`: a strict xfail, with its reason). The environment is allennlp's own
(`make allennlp`); without it this test skips, under CI it fails."""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET

from tests.allennlp_reference import REPO, allennlp_python

# allennlp's 12 tests, by class: the 5 of TestElmo construct Elmo (ours); the others are allennlp's own modules
# (_ElmoBiLm, _ElmoCharacterEncoder, ElmoTokenEmbedder) on the same fixture, which the vendored file runs too.
EXPECTED = {
    "TestElmoBiLm": {
        "test_elmo_bilm": "passed",
        "test_elmo_char_cnn_cache_does_not_raise_error_for_uncached_words": "passed",
        "test_elmo_bilm_can_cache_char_cnn_embeddings": "passed",
    },
    "TestElmo": {
        "test_elmo": "passed",
        "test_elmo_keep_sentence_boundaries": "passed",
        "test_elmo_4D_input": "passed",
        "test_elmo_with_module": "xfailed",
        "test_elmo_bilm_can_handle_higher_dimensional_input_with_cache": "passed",
    },
    "TestElmoRequiresGrad": {"test_elmo_requires_grad": "passed", "test_elmo_does_not_require_grad": "passed"},
    "TestElmoTokenRepresentation": {
        "test_elmo_token_representation": "passed",
        "test_elmo_token_representation_bos_eos": "passed",
    },
}


def outcome(case: ET.Element) -> str:
    if case.find("skipped") is not None:
        skipped = case.find("skipped")
        return "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    return "passed"


def test_allennlps_own_elmo_tests_pass_against_the_drop_in(tmp_path):
    python = allennlp_python()
    report = tmp_path / "report.xml"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'client'}"}
    done = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "tests/client/allennlp210"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    got: dict[str, dict[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        got.setdefault(case.get("classname").rsplit(".", 1)[-1], {})[case.get("name")] = outcome(case)
    assert got == EXPECTED, done.stdout[-4000:]
    assert done.returncode == 0, done.stdout[-3000:]

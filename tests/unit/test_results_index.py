"""benchmarks/results/ holds only the files its README names: every measured claim has its file and command,
and no run is kept that nothing refers to."""

import pathlib
import re

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def named_in_readme() -> set[str]:
    text = (RESULTS / "README.md").read_text()
    return set(re.findall(r"[\w./-]+\.(?:jsonl|json|md|png|txt|log)", text)) | set(re.findall(r"`([\w-]+)/`", text))


def unnamed_result_files() -> list[str]:
    names = named_in_readme()
    unnamed = []
    for path in sorted(RESULTS.rglob("*")):
        if path.is_dir() or path.name == "README.md":
            continue
        rel = path.relative_to(RESULTS).as_posix()
        top = rel.split("/")[0]
        if rel not in names and path.name not in names and f"{top}/{path.name}" not in names and top not in names:
            unnamed.append(rel)
    return unnamed


def test_every_result_file_is_named_by_the_results_readme():
    assert (RESULTS / "README.md").exists()
    assert not unnamed_result_files(), f"result files no claim names: {unnamed_result_files()}"


def test_every_file_the_readme_names_exists():
    present = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*")} | {p.name for p in RESULTS.rglob("*")}
    missing = [name for name in named_in_readme() if name.endswith((".json", ".jsonl"))
               and name.removeprefix("benchmarks/results/") not in present]
    assert not missing, f"results/README.md names missing files: {missing}"

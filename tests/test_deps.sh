#!/usr/bin/env bash
# `make test-deps`: the architecture sample and the resume tests at the dependency bounds, each pair of
# torch and transformers in its own venv under .venv-deps/ (run before changing requirements.txt).
# Default pairs: the oldest the requirements admit and the newest; then the GPU machines' image
# (torch 2.11, transformers 5.17), below the transformers floor, run for the record: its failures are
# reported, not counted (DEPS_REPORT_ONLY). DEPS_COMBOS="torch==2.12.0,transformers==5.23.0 ..."
# chooses others. Other packages resolve as pip picks them for that pair. torch comes from PyPI: its
# Linux wheels pull the nvidia libraries (about 3 GB a venv), which it needs even to import; the tests
# run on CPU all the same. Findings per pair: docs/install.md.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
report_only=(${DEPS_REPORT_ONLY-torch==2.11.0,transformers==5.17.0})
combos=(${DEPS_COMBOS:-torch==2.11.0,transformers==5.23.0 torch==2.15.0,transformers==5.24.0} "${report_only[@]}")
tests=(tests/test_architectures.py tests/test_resume.py)
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false CUDA_VISIBLE_DEVICES=

summary=()
status=0
for combo in "${combos[@]}"; do
  pins=(${combo//,/ })
  name=$(printf '%s' "$combo" | tr -d '=' | tr ',' '-')
  venv=.venv-deps/$name
  echo "=== ${pins[*]} -> $venv"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || { summary+=("$combo: venv failed"); status=1; continue; }
  printf '%s\n' "${pins[@]}" > "$venv/constraints.txt"
  # requirements-dev.txt less torchao, liger-kernel and triton: optional GPU extras these tests do not use,
  # and torchao 0.18 breaks transformers' import under torch < 2.11 (docs/install.md).
  if ! "$venv/bin/python" -m pip install -q "${pins[@]}" -r requirements.txt -c "$venv/constraints.txt" \
      $(grep -hvE '^(torchao|liger-kernel|triton)\b|^-r|^#|^$' requirements-dev.txt) \
      > "$venv/pip.log" 2>&1; then
    summary+=("$combo: install failed ($(tail -n 1 "$venv/pip.log"))"); status=1; continue
  fi
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" > "$venv/pytest.log" 2>&1
  passed=$?
  note=""
  if [[ " ${report_only[*]} " == *" $combo "* ]]; then note=" (outside the requirements: reported only)"
  elif [ $passed != 0 ]; then status=1; fi
  summary+=("$combo (python $("$venv/bin/python" -c 'import platform; print(platform.python_version())')): $(tail -n 1 "$venv/pytest.log")$note")
done
echo
echo "=== test-deps summary (logs: .venv-deps/*/pytest.log)"
printf '%s\n' "${summary[@]}"
exit $status

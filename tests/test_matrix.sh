#!/usr/bin/env bash
# `make test-matrix`: the interpreter-sensitive tests (checkpoint format, data, packing, resume) under
# every Python given, each in its own venv under .venv-matrix/. Default: the system python3 and each
# pyenv 3.11-3.13 found (transformers 5.21 and later need 3.11: an older interpreter is reported, not run).
# torch comes as a CPU build (`torch==X+cpu`); where there is none, MATRIX_PYPI_TORCH=1 installs PyPI's
# build with its nvidia libraries (about 3 GB a venv; it runs on CPU), else the interpreter runs the
# tests that need no torch (reading, converting and tokenizing data) and says so.
set -uo pipefail
cd "$(dirname "$0")/.."
torch_pin=${TORCH_CPU:-torch==2.13.0}
# Reading, converting and tokenizing data needs no torch; packing and the trainer's tests do (sampler.py).
data=(tests/test_process_data.py tests/test_formats.py tests/test_sources.py tests/test_real_templates.py)
with_torch=(tests/test_checkpoint_format.py tests/test_packing.py "${data[@]}" tests/test_data_faults.py
            tests/test_sampler.py tests/test_mix.py tests/test_resume.py)
without_torch=("${data[@]}")

pythons=("$@")
if [ ${#pythons[@]} -eq 0 ]; then
  [ -x /usr/bin/python3 ] && pythons+=(/usr/bin/python3)
  for v in 3.11 3.12 3.13; do
    for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/$v.*/bin/python; do [ -x "$p" ] && pythons+=("$p"); done
  done
fi
[ ${#pythons[@]} -gt 0 ] || { echo "no interpreters given or found"; exit 2; }

summary=()
status=0
for py in "${pythons[@]}"; do
  version=$("$py" -c 'import platform; print(platform.python_version())') || { summary+=("$py: does not run"); status=1; continue; }
  if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    summary+=("$version ($py): not run, below Python 3.11, which transformers 5.21 and later need"); status=1; continue
  fi
  venv=.venv-matrix/$version
  echo "=== Python $version ($py) -> $venv"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv" || { summary+=("$version: venv failed"); status=1; continue; }
  pip=("$venv/bin/python" -m pip install -q)
  if "$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "$torch_pin+cpu" ||
     { [ "${MATRIX_PYPI_TORCH:-0}" = 1 ] && "${pip[@]}" "$torch_pin"; }; then
    "${pip[@]}" -r requirements-dev.txt || { summary+=("$version: install failed"); status=1; continue; }
    tests=("${with_torch[@]}"); torch_note="torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  else
    # Everything but torch and what pulls it in (liger-kernel, triton, peft).
    "${pip[@]}" $(grep -hvE '^(torch|triton|liger-kernel|peft)\b|^-r|^#|^$' requirements.txt requirements-dev.txt) \
      || { summary+=("$version: install failed"); status=1; continue; }
    tests=("${without_torch[@]}"); torch_note="no CPU build of $torch_pin for this interpreter (MATRIX_PYPI_TORCH=1: PyPI's): torch-free tests only"
  fi
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$venv/pytest.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  summary+=("$version ($py), $torch_note: ${tests[*]##*/} -> $(tail -n 1 "$venv/pytest.log")")
done
echo
echo "=== test-matrix summary"
printf '%s\n' "${summary[@]}"
exit $status

#!/usr/bin/env bash
# `make test-matrix`: the interpreter-sensitive tests (checkpoint format, data, packing, resume) under
# every Python given, each in its own venv under .venv-matrix/. Default: the system python3 and each
# pyenv 3.10-3.13 found. torch is installed only as a CPU build (`torch==X+cpu`, never PyPI's CUDA
# wheel, which cannot even import without the multi-GB nvidia libraries); an interpreter with no CPU
# build to install runs the tests that need no torch (process_data, packing) and says so.
set -uo pipefail
cd "$(dirname "$0")/.."
torch_pin=${TORCH_CPU:-torch==2.13.0}
with_torch=(tests/test_checkpoint_format.py tests/test_packing.py tests/test_process_data.py
            tests/test_sampler.py tests/test_data_mix.py tests/test_resume.py)
without_torch=(tests/test_packing.py tests/test_process_data.py)

pythons=("$@")
if [ ${#pythons[@]} -eq 0 ]; then
  [ -x /usr/bin/python3 ] && pythons+=(/usr/bin/python3)
  for v in 3.10 3.11 3.12 3.13; do
    for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/$v.*/bin/python; do [ -x "$p" ] && pythons+=("$p"); done
  done
fi
[ ${#pythons[@]} -gt 0 ] || { echo "no interpreters given or found"; exit 2; }

summary=()
status=0
for py in "${pythons[@]}"; do
  version=$("$py" -c 'import platform; print(platform.python_version())') || { summary+=("$py: does not run"); status=1; continue; }
  venv=.venv-matrix/$version
  echo "=== Python $version ($py) -> $venv"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv" || { summary+=("$version: venv failed"); status=1; continue; }
  pip=("$venv/bin/python" -m pip install -q)
  if "$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "$torch_pin+cpu"; then
    "${pip[@]}" -r requirements-dev.txt || { summary+=("$version: install failed"); status=1; continue; }
    tests=("${with_torch[@]}"); torch_note="torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  else
    # Everything but torch and what pulls it in (liger-kernel, triton, peft).
    "${pip[@]}" $(grep -hvE '^(torch|triton|liger-kernel|peft)\b|^-r|^#|^$' requirements.txt requirements-dev.txt) \
      || { summary+=("$version: install failed"); status=1; continue; }
    tests=("${without_torch[@]}"); torch_note="no CPU build of $torch_pin for this interpreter: torch-free tests only"
  fi
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$venv/pytest.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  summary+=("$version ($py), $torch_note: ${tests[*]##*/} -> $(tail -n 1 "$venv/pytest.log")")
done
echo
echo "=== test-matrix summary"
printf '%s\n' "${summary[@]}"
exit $status

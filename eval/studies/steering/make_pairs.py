"""The contrast pairs of docs/steering.md's measurements, question text only (no gold answer is read).

CommonsenseQA: dev rows 150-299. GSM8K: train rows 0-149 (brevity) and 150-299 (the answer line);
none of them is a dev or report row. Run from the repository root:

    .venv/bin/python -m eval.studies.steering.make_pairs   # writes results/steering/<concept>.jsonl
"""
import json


def csqa_question(row: dict) -> str:
    options = "\n".join(f"{label}. {text}" for label, text in zip(row["choices"]["label"], row["choices"]["text"]))
    return f"{row['question']}\n{options}"


def rows(path: str, start: int, stop: int) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f][start:stop]


def concepts() -> dict[str, tuple[list[str], str, str]]:
    """Concept name -> (questions, positive instruction, negative instruction)."""
    return {
        "csqa_letter_stop": ([csqa_question(r) for r in rows("data/commonsenseqa_dev300.jsonl", 150, 300)],
                             "Answer with the option letter only, then stop.",
                             "Explain your reasoning step by step before you give the answer."),
        "csqa_brevity": ([csqa_question(r) for r in rows("data/commonsenseqa_dev300.jsonl", 150, 300)],
                         "Answer in as few words as you can.",
                         "Answer at length, in several detailed paragraphs."),
        "gsm8k_brevity": ([r["question"] for r in rows("data/gsm8k_train7473.jsonl", 0, 150)],
                          "Solve it briefly: only the key calculations, in as few words as you can.",
                          "Solve it at length: explain every step in full detail, in several paragraphs."),
        "gsm8k_answer_line": ([r["question"] for r in rows("data/gsm8k_train7473.jsonl", 150, 300)],
                              "Solve the problem. Write the final answer on the last line as 'Answer: <number>', "
                              "in plain text, without LaTeX.",
                              "Solve the problem. Write the final answer in LaTeX, as \\boxed{<number>}."),
    }


def main() -> None:
    for name, (questions, positive, negative) in concepts().items():
        with open(f"results/steering/{name}.jsonl", "w") as f:
            for question in questions:
                f.write(json.dumps({"positive": f"{question}\n{positive}", "negative": f"{question}\n{negative}"}) + "\n")


if __name__ == "__main__":
    main()

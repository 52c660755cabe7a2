"""The contrast pairs of docs/steering.md's CommonsenseQA measurement: dev rows 150-299, question text only."""
import json

rows = [json.loads(l) for l in open("data/commonsenseqa_dev300.jsonl")][150:300]
def q(r):
    return r["question"] + "\n" + "\n".join(f"{l}. {t}" for l, t in zip(r["choices"]["label"], r["choices"]["text"]))
concepts = {
    "csqa_letter_stop": ("Answer with the option letter only, then stop.", "Explain your reasoning step by step before you give the answer."),
    "csqa_brevity": ("Answer in as few words as you can.", "Answer at length, in several detailed paragraphs."),
}
for name, (pos, neg) in concepts.items():
    with open(f"results/steering/{name}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"positive": f"{q(r)}\n{pos}", "negative": f"{q(r)}\n{neg}"}) + "\n")

#!/usr/bin/env python3
"""Builds the drafter prompt sets (issue #5) deterministically; outputs are committed.

- train.jsonl: drafter self-distillation prompts: HumanEval tasks 0-95 (code), templated
  grade-school math word problems (math) and templated assistant questions (chat).
- code.jsonl / math.jsonl / chat.jsonl: evaluation prompts, disjoint from train.jsonl:
  HumanEval tasks 120-163; math problems from templates never used in training; chat
  questions on topics never used in training.

Usage: python3 data/prompts/make_prompts.py [HumanEval.jsonl]
(default ~/.cache/dspark/data/HumanEval.jsonl). No network access needed.
"""
import json, os, random, sys

here = os.path.dirname(os.path.abspath(__file__))
he_path = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/dspark/data/HumanEval.jsonl")
he = [json.loads(l) for l in open(he_path) if l.strip()]

def code(task):
    return {"id": task["task_id"].replace("/", "-"), "domain": "code",
            "prompt": "Complete this Python function.\n\n```python\n" + task["prompt"] + "```"}

MATH_TRAIN = [
    "A baker makes {a} loaves of bread every day. He sells {b} of them and gives the rest to a shelter. How many loaves does the shelter get in {c} days?",
    "Sara has {a} marbles. She buys {b} bags with {c} marbles each. How many marbles does she have now?",
    "A book costs ${a} and a pen costs ${b}. How much do {c} books and {d} pens cost together?",
    "A car travels {a} km per hour. How far does it go in {c} hours and 30 minutes?",
    "There are {a} students in a class. {p}% of them are girls. How many boys are in the class?",
    "Tom earns ${a} per hour and works {c} hours a day, {d} days a week. How much does he earn in a week?",
    "A garden is {a} meters long and {b} meters wide. What is its area and its perimeter?",
    "Lisa read {a} pages on Monday and twice as many on Tuesday. How many pages did she read in total?",
    "A box holds {c} apples. How many boxes are needed for {a} apples?",
    "A shirt costs ${a}. It is on sale for {p}% off. What is the sale price?",
    "John is {c} years old. His father is {d} times as old. How old will his father be in {b} years?",
    "A tank holds {a} liters. It is filled at {c} liters per minute. How long does it take to fill it?",
    "Anna saves ${c} every week. How many weeks does she need to save ${a}?",
    "A train has {c} cars with {b} seats each. If {a} seats are taken, how many are free?",
]
MATH_EVAL = [
    "A farmer has {a} chickens and {b} cows. How many legs do the animals have in total?",
    "A pizza is cut into {c} slices. {d} friends each eat 2 slices. How many slices are left from {b} pizzas?",
    "A runner runs {c} km every morning and {d} km every evening. How far does she run in {b} days?",
    "The price of a ticket rose from ${b} to ${a}. By what percent did it increase?",
    "A school buys {a} pencils in packs of {c}. Each pack costs ${d}. What is the total cost?",
    "Mike had ${a}. He spent a quarter of it on food and ${b} on a book. How much money is left?",
]

def math_problems(templates, n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = templates[i % len(templates)]
        v = dict(a=rng.randint(20, 400), b=rng.randint(2, 19), c=rng.randint(2, 12),
                 d=rng.randint(2, 9), p=rng.choice([10, 15, 20, 25, 30, 40, 50]))
        out.append(t.format(**v) + " Explain step by step.")
    return out

CHAT_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What are the main advantages and disadvantages of {t}?",
    "Give me three practical tips about {t}.",
    "Write a short paragraph about {t} for a beginner.",
    "What are common mistakes people make with {t}?",
]
TOPICS_TRAIN = ["public transport", "learning a new language", "cloud computing", "healthy breakfast",
    "saving money", "remote work", "electric cars", "photosynthesis", "time management", "recycling",
    "social media", "gardening", "version control with git", "running a marathon", "solar energy",
    "writing a resume", "meditation", "the water cycle", "online privacy", "cooking pasta"]
TOPICS_EVAL = ["volcanoes", "buying a used bicycle", "password managers", "drinking enough water",
    "public speaking", "machine learning", "composting", "the stock market"]

def chat(topics, seed, n):
    rng = random.Random(seed)
    pairs = [(t, tp) for t in topics for tp in CHAT_TEMPLATES]
    rng.shuffle(pairs)
    return [tp.format(t=t) for t, tp in pairs[:n]]

def write(name, rows):
    with open(os.path.join(here, name), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")

train = [code(t) for t in he[:96]]
train += [{"id": f"math-train-{i:03d}", "domain": "math", "prompt": p}
          for i, p in enumerate(math_problems(MATH_TRAIN, 80, 1))]
train += [{"id": f"chat-train-{i:03d}", "domain": "chat", "prompt": p}
          for i, p in enumerate(chat(TOPICS_TRAIN, 2, 80))]
random.Random(3).shuffle(train)
write("train.jsonl", train)
write("code.jsonl", [code(t) for t in he[120:164]])
write("math.jsonl", [{"id": f"math-eval-{i:03d}", "domain": "math", "prompt": p}
                     for i, p in enumerate(math_problems(MATH_EVAL, 30, 11))])
write("chat.jsonl", [{"id": f"chat-eval-{i:03d}", "domain": "chat", "prompt": p}
                     for i, p in enumerate(chat(TOPICS_EVAL, 12, 30))])

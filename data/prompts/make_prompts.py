#!/usr/bin/env python3
"""Builds the drafter prompt sets (issue #5) deterministically; outputs are committed.

- train.jsonl: drafter self-distillation prompts: HumanEval tasks 0-119 and templated
  small-function tasks (code), templated grade-school math word problems (math) and
  templated assistant questions (chat); about 1500 prompts.
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
TOPICS_TRAIN += ["the solar system", "baking bread", "budget travel", "learning to swim",
    "home networking", "first aid", "birdwatching", "digital photography", "climate change",
    "job interviews", "sleep hygiene", "the French revolution", "electric guitars",
    "houseplants", "spreadsheets", "the immune system", "camping", "renewable energy",
    "chess openings", "team sports", "painting with watercolors", "starting a small business",
    "email etiquette", "the internet", "vaccines", "volunteering", "minimalism",
    "learning to code", "podcasts", "board games", "renting an apartment", "car maintenance",
    "the moon", "honey bees", "ancient Rome", "3D printing", "open source software",
    "yoga", "coffee brewing", "jazz music", "stress management", "note taking",
    "data backups", "cycling to work", "the printing press", "rainforests", "earthquakes",
    "credit scores", "wind turbines", "museums", "city planning", "ocean tides",
    "video games", "dog training", "knitting", "weather forecasts", "DNA",
    "bridges", "libraries", "fermentation", "origami", "black holes"]
CHAT_TEMPLATES_TRAIN = CHAT_TEMPLATES + [
    "How would you explain {t} to a ten-year-old?",
    "List five interesting facts about {t}.",
    "What should I know before getting started with {t}?",
]
TOPICS_EVAL = ["volcanoes", "buying a used bicycle", "password managers", "drinking enough water",
    "public speaking", "machine learning", "composting", "the stock market"]

def chat(topics, seed, n, templates=CHAT_TEMPLATES):
    rng = random.Random(seed)
    pairs = [(t, tp) for t in topics for tp in templates]
    rng.shuffle(pairs)
    return [tp.format(t=t) for t, tp in pairs[:n]]

# Small-function tasks for more code data (HumanEval has only 164 problems; 120-163 are
# the evaluation set).
CODE_TASKS = [
    ("reverse_words", "s: str", "str", "reverses the order of the words in a sentence"),
    ("count_vowels", "s: str", "int", "counts the vowels in a string"),
    ("is_palindrome", "s: str", "bool", "checks whether a string is a palindrome, ignoring case and spaces"),
    ("fibonacci", "n: int", "int", "returns the n-th Fibonacci number"),
    ("flatten", "xs: list", "list", "flattens a nested list of integers"),
    ("merge_sorted", "a: list, b: list", "list", "merges two sorted lists into one sorted list"),
    ("word_count", "text: str", "dict", "counts how often each word occurs in a text"),
    ("gcd", "a: int, b: int", "int", "returns the greatest common divisor of two integers"),
    ("is_prime", "n: int", "bool", "checks whether a number is prime"),
    ("primes_below", "n: int", "list", "returns all prime numbers below n"),
    ("chunk", "xs: list, size: int", "list", "splits a list into chunks of the given size"),
    ("dedupe", "xs: list", "list", "removes duplicates from a list while keeping the order"),
    ("second_largest", "xs: list", "int", "returns the second largest distinct number in a list"),
    ("capitalize_words", "s: str", "str", "capitalizes the first letter of every word"),
    ("binary_search", "xs: list, target: int", "int", "returns the index of target in a sorted list or -1"),
    ("transpose", "m: list", "list", "transposes a matrix given as a list of rows"),
    ("running_sum", "xs: list", "list", "returns the running sums of a list of numbers"),
    ("celsius_to_fahrenheit", "c: float", "float", "converts a temperature from Celsius to Fahrenheit"),
    ("digit_sum", "n: int", "int", "returns the sum of the digits of a non-negative integer"),
    ("anagrams", "a: str, b: str", "bool", "checks whether two strings are anagrams"),
    ("rotate", "xs: list, k: int", "list", "rotates a list to the right by k positions"),
    ("max_subarray", "xs: list", "int", "returns the largest sum of a contiguous sub-list"),
    ("roman_to_int", "s: str", "int", "converts a Roman numeral to an integer"),
    ("int_to_binary", "n: int", "str", "returns the binary representation of a non-negative integer"),
    ("most_common", "xs: list", "object", "returns the most common element of a list"),
    ("valid_parentheses", "s: str", "bool", "checks whether the brackets in a string are balanced"),
    ("pairs_with_sum", "xs: list, target: int", "list", "returns all pairs of numbers that add up to target"),
    ("factorial", "n: int", "int", "returns n factorial"),
    ("remove_punctuation", "s: str", "str", "removes punctuation characters from a string"),
    ("average", "xs: list", "float", "returns the average of a list of numbers, or 0.0 when it is empty"),
    ("longest_word", "text: str", "str", "returns the longest word in a text"),
    ("matrix_multiply", "a: list, b: list", "list", "multiplies two matrices given as lists of rows"),
    ("caesar_cipher", "s: str, shift: int", "str", "encrypts a string with a Caesar cipher"),
    ("leap_year", "year: int", "bool", "checks whether a year is a leap year"),
    ("find_missing", "xs: list", "int", "finds the missing number in a list containing 0..n with one number missing"),
    ("group_by_length", "words: list", "dict", "groups words by their length"),
    ("snake_to_camel", "s: str", "str", "converts a snake_case name to camelCase"),
    ("count_islands", "grid: list", "int", "counts groups of connected 1s in a grid of 0s and 1s"),
    ("median", "xs: list", "float", "returns the median of a list of numbers"),
    ("compress", "s: str", "str", "compresses a string by counting repeated characters, like aaab -> a3b1"),
]
CODE_TEMPLATES = [
    "Write a Python function `{name}({args}) -> {ret}` that {desc}. Include a docstring.",
    "Implement `def {name}({args}) -> {ret}:` in Python. It {desc}.",
    "Write a Python function that {desc}. Call it `{name}` and add a few test cases.",
    "Write {name}({args}) in Python: it {desc}. Explain how it works.",
]

def code_tasks():
    out = []
    for i, (name, args, ret, desc) in enumerate(CODE_TASKS):
        for j, t in enumerate(CODE_TEMPLATES):
            out.append({"id": f"code-train-{i:02d}-{j}", "domain": "code",
                        "prompt": t.format(name=name, args=args, ret=ret, desc=desc)})
    return out

def write(name, rows):
    with open(os.path.join(here, name), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")

train = [code(t) for t in he[:120]] + code_tasks()
train += [{"id": f"math-train-{i:03d}", "domain": "math", "prompt": p}
          for i, p in enumerate(math_problems(MATH_TRAIN, 560, 1))]
train += [{"id": f"chat-train-{i:03d}", "domain": "chat", "prompt": p}
          for i, p in enumerate(chat(TOPICS_TRAIN, 2, 640, CHAT_TEMPLATES_TRAIN))]
random.Random(3).shuffle(train)
write("train.jsonl", train)
write("code.jsonl", [code(t) for t in he[120:164]])
write("math.jsonl", [{"id": f"math-eval-{i:03d}", "domain": "math", "prompt": p}
                     for i, p in enumerate(math_problems(MATH_EVAL, 30, 11))])
write("chat.jsonl", [{"id": f"chat-eval-{i:03d}", "domain": "chat", "prompt": p}
                     for i, p in enumerate(chat(TOPICS_EVAL, 12, 30))])

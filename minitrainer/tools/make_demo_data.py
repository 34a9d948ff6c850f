"""Write ``minitrainer/tools/demo_chat.jsonl``, the small chat dataset that ships with the package.

    python -m minitrainer.tools.make_demo_data         # rewrites minitrainer/tools/demo_chat.jsonl
    python -m minitrainer.tools.make_demo_data --output /tmp/demo.jsonl --seed 1

The committed file is this script's output with the default seed, so the demo
never needs the network. Rows are ``{"id", "source", "messages"}``: multi-turn
conversations (some with a system prompt) built from hand-written topic notes
and from small tasks whose answers are computed here (arithmetic, unit
conversions, sorting), so every reply is correct; plus pretrain rows
(``{"role": "pretrain"}``) of plain prose.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly tutor. Explain things simply and check the student's understanding.",
    "You are a concise assistant. Answer in as few sentences as possible.",
    "You are a patient teacher who uses everyday examples.",
    "You are an assistant for a small public library. Be warm and practical.",
    "You are a careful assistant. If you are unsure, say so.",
]

# (topic, question, answer, follow-up question, follow-up answer)
NOTES = [
    ("photosynthesis", "How does photosynthesis work?",
     "Plants capture light with chlorophyll in their leaves. They use that energy to turn water and carbon "
     "dioxide into glucose, a sugar they can store or burn, and they release oxygen as a by-product.",
     "Where does the oxygen come from, the water or the carbon dioxide?",
     "It comes from the water. When the plant splits water molecules during the light reactions, the oxygen "
     "atoms pair up and leave the leaf as oxygen gas."),
    ("tides", "What causes ocean tides?",
     "Tides are caused mostly by the Moon's gravity. It pulls slightly harder on the side of the Earth facing "
     "it than on the far side, which stretches the oceans into two bulges. As the Earth turns, a coast passes "
     "through both bulges, so most places see two high tides a day.",
     "Does the Sun play a role too?",
     "Yes, about half as strongly as the Moon. When the Sun and Moon line up, at new and full moon, their pulls "
     "add up and we get larger spring tides. When they are at right angles, we get smaller neap tides."),
    ("bread", "Why does bread dough need to rise?",
     "Yeast in the dough eats sugars and releases carbon dioxide. The gas gets trapped in the stretchy gluten "
     "network, which makes the dough puff up. Without that rise the bread would be dense and heavy.",
     "How do I know when it has risen enough?",
     "A common test is to press a floured finger about a centimetre into the dough. If the dent springs back "
     "slowly and only partly, it is ready. If it springs back at once, give it more time."),
    ("compound interest", "Can you explain compound interest?",
     "Compound interest means you earn interest on your interest. If you save 100 dollars at 5 percent a year, "
     "you have 105 after one year, and the next year you earn 5 percent of 105, not of 100. Over many years the "
     "growth speeds up.",
     "Is there a quick way to estimate how long it takes to double?",
     "Use the rule of 72: divide 72 by the yearly rate in percent. At 6 percent, money doubles in about 12 "
     "years. It is an approximation, but a good one for ordinary rates."),
    ("sleep", "How much sleep do adults need?",
     "Most adults do best with seven to nine hours a night. Regular times matter too: going to bed and getting "
     "up at about the same time each day helps the body keep a steady rhythm.",
     "Any tips for falling asleep faster?",
     "Keep the bedroom cool and dark, avoid caffeine in the afternoon, and put screens away half an hour before "
     "bed. If you cannot sleep after twenty minutes, get up and read something calm until you feel drowsy."),
    ("python lists", "What is the difference between a list and a tuple in Python?",
     "A list is mutable: you can add, remove and change items after creating it. A tuple is immutable: once "
     "made, it cannot change. Tuples are handy for fixed groups of values, like a point (x, y), and they can be "
     "used as dictionary keys.",
     "When should I prefer a list?",
     "Use a list when the collection will grow or change, for example when you collect results in a loop. If "
     "the data is a fixed record that should not be modified, a tuple states that intent clearly."),
    ("git", "What does git commit actually do?",
     "It records a snapshot of the files you staged with git add, together with a message, your name and the "
     "time. Each commit points to its parent, so the history forms a chain you can inspect or go back to.",
     "And what is the difference between commit and push?",
     "A commit only changes your local repository. Push sends your new commits to a remote, such as a shared "
     "server, so other people can fetch them."),
    ("rainbows", "Why do rainbows appear?",
     "Sunlight enters raindrops, bends, reflects off the back of the drop and bends again on the way out. Each "
     "colour bends by a slightly different amount, so white light spreads into a band of colours.",
     "Why is a rainbow always curved?",
     "Each colour leaves the drops at a fixed angle, about 42 degrees for red, measured from the point directly "
     "opposite the Sun. All the drops at that angle form a circle around that point, and the ground hides the "
     "lower part, so we see an arc."),
    ("vaccines", "How do vaccines work?",
     "A vaccine shows the immune system a harmless piece or weakened form of a germ. The body learns to "
     "recognise it and keeps memory cells, so if the real germ arrives later, the defence starts much faster.",
     "Why do some vaccines need boosters?",
     "For some germs the immune memory fades over the years, and some viruses change. A booster refreshes the "
     "memory so protection stays strong."),
    ("tea", "How do I make a good cup of black tea?",
     "Use freshly boiled water, about one teaspoon of leaves or one bag per cup, and steep for three to five "
     "minutes. Shorter gives a lighter taste; longer makes it stronger and more bitter.",
     "Should milk go in first or last?",
     "It is mostly a matter of taste. Adding milk after steeping lets you judge the strength by the colour, "
     "which is why many people prefer it last."),
    ("recycling", "Why should I rinse containers before recycling them?",
     "Food left in containers can spoil a whole bale of paper or plastic at the sorting plant. A quick rinse "
     "keeps the material clean enough to be turned into something new.",
     "Do I need to remove the labels?",
     "Usually not. Most recycling plants remove paper labels during washing. Check your local rules, though, "
     "because they differ from town to town."),
    ("exercise", "How often should I exercise each week?",
     "A common guideline is at least 150 minutes of moderate activity a week, such as brisk walking, plus "
     "muscle-strengthening exercise on two days. Spreading it over most days works better than one long session.",
     "I only have twenty minutes a day. Is that enough?",
     "Twenty minutes every day adds up to 140 minutes a week, which is close to the guideline. Make some of "
     "those sessions a bit more vigorous and you will get most of the benefit."),
    ("memory", "What is the best way to memorise vocabulary?",
     "Spaced repetition works best: review a word just as you are about to forget it, with the gaps growing "
     "longer each time. Saying the word aloud and using it in a sentence also helps it stick.",
     "How many new words per day is reasonable?",
     "Ten to twenty new words a day is sustainable for most learners, as long as you keep up with the reviews. "
     "Reviews grow quickly, so it is better to be steady than ambitious."),
    ("seasons", "Why do we have seasons?",
     "The Earth's axis is tilted by about 23 degrees. As the Earth orbits the Sun, each hemisphere spends part "
     "of the year tilted towards the Sun, with longer days and more direct light, and part tilted away.",
     "So it is not because the Earth is closer to the Sun in summer?",
     "No. The Earth is actually closest to the Sun in early January, during the northern winter. The tilt "
     "matters far more than the small change in distance."),
    ("houseplants", "Why are the leaves of my houseplant turning yellow?",
     "The most common cause is overwatering, which starves the roots of air. Other causes are too little "
     "light or a lack of nutrients. Check whether the soil stays wet for days after watering.",
     "The soil is always wet. What should I do?",
     "Let it dry out until the top few centimetres feel dry before watering again, and make sure the pot has a "
     "drainage hole. If the roots smell bad, repot the plant in fresh soil."),
    ("email", "How should I start a formal email to someone I have never met?",
     "Begin with a greeting such as 'Dear Ms Patel,' and, in the first sentence, say who you are and why you "
     "are writing. Keep the request clear and short, and end with 'Kind regards' and your full name.",
     "What if I do not know their name?",
     "Try to find it on the organisation's website first. If you cannot, 'Dear hiring team' or 'Dear support "
     "team' is better than the old-fashioned 'To whom it may concern'."),
    ("volcanoes", "How do volcanoes form?",
     "Most volcanoes form where tectonic plates pull apart or where one plate sinks beneath another. There, "
     "rock melts into magma, which is lighter than the rock around it and rises until it breaks through the "
     "surface.",
     "What about Hawaii? It is not at a plate edge.",
     "Right. Hawaii sits above a hot spot, a plume of hot material rising from deep in the mantle. As the "
     "Pacific plate slides over it, new islands form and older ones move away and cool."),
    ("budgeting", "How do I start a simple monthly budget?",
     "List your income after tax, then your fixed costs such as rent and bills. Decide how much goes to "
     "savings first, and divide what is left between food, transport and everything else.",
     "What is the 50/30/20 rule?",
     "It is a rough guide: 50 percent of income for needs, 30 percent for wants and 20 percent for savings or "
     "paying off debt. Adjust it to your situation; it is a starting point, not a law."),
    ("gradient descent", "What is gradient descent?",
     "It is a way to minimise a function step by step. At each step you compute the slope, the gradient, and "
     "move a small distance in the direction that goes downhill. Repeating this slowly lowers the loss.",
     "What happens if the learning rate is too large?",
     "The steps overshoot the valley, so the loss jumps around or even grows. Too small a rate is safe but "
     "slow. In practice people try a few values and watch the loss curve."),
    ("overfitting", "What does overfitting mean in machine learning?",
     "A model overfits when it learns the training examples too precisely, including their noise, and then "
     "does worse on new data. The training loss keeps falling while the validation loss starts to rise.",
     "How can I prevent it?",
     "Use more data, stop training when validation loss stops improving, add regularisation such as weight "
     "decay or dropout, or choose a smaller model."),
    ("tokenizers", "What is a tokenizer in a language model?",
     "A tokenizer splits text into pieces called tokens and maps each piece to a number. Frequent words often "
     "become one token, while rare words are split into several smaller pieces.",
     "Why not just use whole words?",
     "There are too many words, and new ones appear all the time. Sub-word pieces keep the vocabulary to a "
     "fixed size while still being able to spell out any word."),
    ("bicycles", "How do I fix a flat bicycle tyre?",
     "Remove the wheel, lever one side of the tyre off the rim and pull out the inner tube. Find the hole by "
     "pumping some air in and listening, then patch it or fit a new tube. Check the inside of the tyre for "
     "thorns before putting it back.",
     "How hard should I pump the tyre?",
     "The recommended pressure range is printed on the side of the tyre. Road bikes usually need more pressure "
     "than mountain bikes; stay within the printed range."),
    ("coffee", "Why does coffee keep me awake?",
     "Caffeine blocks adenosine, a chemical that builds up in the brain during the day and makes you feel "
     "sleepy. With its receptors blocked, you feel more alert for a few hours.",
     "How long does it stay in the body?",
     "Caffeine's half-life is about five hours in most adults, so half of an afternoon coffee may still be "
     "active at bedtime. That is why many people stop drinking coffee after lunch."),
    ("public speaking", "I get very nervous before giving a presentation. Any advice?",
     "Practise out loud several times, ideally in front of a friend. Know your first two sentences by heart, "
     "because the start is when nerves are strongest. Slow, deep breaths before you begin also help.",
     "What if I forget what to say in the middle?",
     "Pause, take a breath and look at your notes; a short silence feels much longer to you than to the "
     "audience. Keeping one keyword per slide makes it easy to find your place again."),
    ("moon phases", "Why does the Moon change shape during the month?",
     "The Moon does not change shape; we see different amounts of its sunlit half. As it orbits the Earth "
     "over about 29.5 days, the angle between the Sun, Earth and Moon changes, so the lit part we see grows and "
     "shrinks.",
     "What is a gibbous moon?",
     "It is the phase when more than half of the Moon's face is lit but it is not yet full, or just after "
     "full. It appears between the quarter moons and the full moon."),
    ("soap", "How does soap clean grease off my hands?",
     "Soap molecules have one end that likes water and one end that likes oil. The oily ends grab the grease, "
     "and the water-loving ends face outward, so the grease is wrapped in tiny balls that rinse away.",
     "Is hot water necessary?",
     "Not really. Warm water feels nicer and melts some fats, but scrubbing with soap for about twenty seconds "
     "matters much more than the temperature."),
    ("binary numbers", "How do binary numbers work?",
     "Binary uses only the digits 0 and 1. Each position is worth twice the one to its right: 1, 2, 4, 8 and "
     "so on. So 1011 in binary is 8 + 0 + 2 + 1, which is 11.",
     "How would I write 6 in binary?",
     "6 is 4 + 2, so you set the 4 and the 2 positions: 110."),
    ("habits", "How can I build a new habit and keep it?",
     "Start very small, so small that it is hard to skip, such as one push-up or one page of reading. Tie it to "
     "something you already do every day, like right after brushing your teeth, and track it on a calendar.",
     "What if I miss a day?",
     "Missing one day does little harm. The important part is not to miss two in a row. Just start again the "
     "next day without trying to make up for it."),
    ("electric cars", "Are electric cars really better for the environment?",
     "Over their whole life, most studies find that electric cars produce less carbon dioxide than petrol cars, "
     "even after counting battery production. The gap is largest where electricity comes from clean sources.",
     "What about the batteries when they wear out?",
     "Old car batteries can often be reused for storing energy in buildings, and recycling plants can recover "
     "much of the lithium, nickel and cobalt. Recycling capacity is still growing."),
    ("libraries", "What can I do at a public library besides borrowing books?",
     "Many libraries lend e-books and audiobooks, offer free computers and internet, host reading groups and "
     "homework help, and have study rooms you can book. Some even lend tools or musical instruments.",
     "Do I need to pay for a library card?",
     "In most places a card is free for residents. You usually only need proof of address."),
    ("stars", "Why do stars twinkle?",
     "Starlight passes through layers of moving air with slightly different temperatures. Each layer bends the "
     "light a little differently, so the point of light seems to flicker and shift.",
     "Then why do planets twinkle less?",
     "Planets are close enough to appear as tiny discs rather than points. The flickering from different parts "
     "of the disc averages out, so their light looks steadier."),
    ("resume", "What should I put at the top of my CV?",
     "Put your name and contact details, then a short summary of two or three lines saying what you do and "
     "what you are looking for. Recruiters often read only the top third, so make it count.",
     "Should I include a photo?",
     "It depends on the country. In the United States and the United Kingdom photos are usually left out, "
     "while in parts of Europe they are common. Follow local custom."),
    ("hiking", "What should I pack for a day hike?",
     "Bring water, snacks, a map or phone with offline maps, a rain jacket, sun protection and a small first "
     "aid kit. Wear shoes you have already walked in, and tell someone where you are going.",
     "How much water is enough?",
     "About half a litre per hour of walking is a common rule, more in hot weather. It is better to carry a "
     "little extra than to run out."),
    ("sorting algorithms", "Why is quicksort usually fast?",
     "Quicksort picks a pivot, puts smaller items on one side and larger on the other, and then sorts each side "
     "the same way. With good pivots it takes about n log n steps, and its inner loop is very simple, so it "
     "runs quickly in practice.",
     "When does it become slow?",
     "If the pivot is always the smallest or largest item, for example on already sorted data with a naive "
     "pivot choice, it degrades to about n squared steps. Choosing a random pivot avoids this."),
    ("fermentation", "How is yogurt made?",
     "Milk is heated, cooled to about 43 degrees Celsius and mixed with live bacteria. Over several hours the "
     "bacteria turn lactose into lactic acid, which thickens the milk and gives yogurt its tangy taste.",
     "Can I make it at home without a machine?",
     "Yes. Keep the jar warm in an oven with only the light on, or wrap it in towels in a cool box. Use a "
     "spoonful of plain yogurt with live cultures as the starter."),
    ("languages", "Is it harder for adults to learn a new language than for children?",
     "Children tend to reach a more native-like accent, but adults often learn grammar and vocabulary faster at "
     "first because they can study deliberately. Regular practice matters more than age.",
     "What is the fastest way to improve speaking?",
     "Speak as often as you can, even badly. A weekly conversation partner or tutor, plus shadowing, repeating "
     "audio right after the speaker, makes a big difference."),
    ("thunder", "Why do we see lightning before we hear thunder?",
     "Light travels about a million times faster than sound. The flash reaches you almost instantly, while the "
     "sound travels roughly one kilometre every three seconds.",
     "So can I tell how far away the storm is?",
     "Count the seconds between the flash and the thunder and divide by three to get the distance in "
     "kilometres, or by five for miles."),
    ("spreadsheets", "How do I add up a column in a spreadsheet?",
     "Click the cell below the numbers and type =SUM(A1:A10), replacing the range with your own cells. Press "
     "Enter and the total appears. Most programs also have an AutoSum button that guesses the range.",
     "How do I get the average instead?",
     "Use =AVERAGE(A1:A10) in the same way. It ignores empty cells but counts cells that contain zero."),
    ("batteries", "Should I let my phone battery drain completely before charging?",
     "No. Modern lithium-ion batteries prefer shallow cycles. Charging whenever it is convenient, and avoiding "
     "long periods at zero or at full charge in the heat, keeps the battery healthy longer.",
     "Is it bad to charge overnight?",
     "Phones stop charging when full, and many now pause at about 80 percent overnight to reduce wear. Keeping "
     "the phone cool while it charges matters more."),
    ("chess", "What is a good opening principle in chess for beginners?",
     "Control the centre with your pawns, develop your knights and bishops early, and castle to keep your king "
     "safe. Avoid moving the same piece twice in the opening unless you have a good reason.",
     "When should I bring out my queen?",
     "Usually not too early. If the queen comes out in the first few moves, the opponent can chase it with "
     "minor pieces and gain time. Develop the smaller pieces first."),
]

COUNTRIES = [
    ("France", "Paris", "Europe"), ("Japan", "Tokyo", "Asia"), ("Kenya", "Nairobi", "Africa"),
    ("Canada", "Ottawa", "North America"), ("Brazil", "Brasilia", "South America"),
    ("Australia", "Canberra", "Oceania"), ("Egypt", "Cairo", "Africa"), ("India", "New Delhi", "Asia"),
    ("Norway", "Oslo", "Europe"), ("Mexico", "Mexico City", "North America"), ("Peru", "Lima", "South America"),
    ("Italy", "Rome", "Europe"), ("Vietnam", "Hanoi", "Asia"), ("Ghana", "Accra", "Africa"),
    ("Argentina", "Buenos Aires", "South America"), ("Poland", "Warsaw", "Europe"),
    ("New Zealand", "Wellington", "Oceania"), ("Turkey", "Ankara", "Asia and Europe"),
    ("Morocco", "Rabat", "Africa"), ("Chile", "Santiago", "South America"), ("Portugal", "Lisbon", "Europe"),
    ("Thailand", "Bangkok", "Asia"), ("Spain", "Madrid", "Europe"), ("Nigeria", "Abuja", "Africa"),
]

WORDS = ["apple", "river", "candle", "mountain", "violin", "garden", "pencil", "ocean", "lantern", "meadow",
         "bridge", "falcon", "harbor", "island", "jacket", "kettle", "lemon", "marble", "needle", "orchid",
         "pillow", "quartz", "saddle", "tunnel", "walnut", "yellow", "zebra", "basket", "cactus", "dolphin"]

PYTHON_TASKS = [
    ("Write a Python function that returns the largest number in a list.",
     "Here is a simple version:\n\n```python\ndef largest(numbers):\n    best = numbers[0]\n    for n in numbers[1:]:\n"
     "        if n > best:\n            best = n\n    return best\n```\n\nIn everyday code you can also just call the "
     "built-in max(numbers).",
     "What happens if the list is empty?",
     "numbers[0] raises an IndexError. You could check first with `if not numbers: return None`, or let the "
     "error tell the caller that an empty list makes no sense here."),
    ("How do I read a text file line by line in Python?",
     "Open it with a with-block so it is closed automatically:\n\n```python\nwith open(\"notes.txt\", encoding=\"utf-8\") "
     "as f:\n    for line in f:\n        print(line.rstrip())\n```\n\nIterating over the file reads one line at a "
     "time, so it also works for very large files.",
     "Why rstrip?",
     "Each line keeps its newline character at the end. rstrip() removes it, and any trailing spaces, so print "
     "does not add an extra blank line."),
    ("How can I count how often each word appears in a sentence using Python?",
     "collections.Counter does it in one line:\n\n```python\nfrom collections import Counter\n\nsentence = \"the cat and "
     "the hat\"\ncounts = Counter(sentence.split())\nprint(counts.most_common(2))\n```\n\nThis prints "
     "[('the', 2), ('cat', 1)].",
     "How do I ignore upper and lower case?",
     "Lower-case the sentence first: Counter(sentence.lower().split()). Then 'The' and 'the' count as the "
     "same word."),
    ("What does a list comprehension look like in Python?",
     "It builds a list in one expression. For example, the squares of 0 to 4:\n\n```python\nsquares = [n * n for n in "
     "range(5)]\n```\n\nThis gives [0, 1, 4, 9, 16].",
     "Can I add a condition?",
     "Yes, put an if at the end: [n * n for n in range(10) if n % 2 == 0] keeps only the even numbers, giving "
     "[0, 4, 16, 36, 64]."),
    ("How do I reverse a string in Python?",
     "Use slicing with a step of -1:\n\n```python\ntext = \"hello\"\nprint(text[::-1])\n```\n\nThis prints olleh.",
     "Is there a way to check if a word is a palindrome with that?",
     "Yes: `word == word[::-1]` is True for palindromes such as 'level' or 'racecar'. Lower-case the word first "
     "if capital letters may appear."),
]

REWRITES = [
    ("hey, can u send me the report asap? thx",
     "Hello, could you please send me the report as soon as possible? Thank you."),
    ("The meeting has been moved to Thursday because of the holiday.",
     "Heads up: the meeting's now on Thursday because of the holiday."),
    ("i cant come tomorrow, sick", "I am sorry, but I will not be able to attend tomorrow because I am unwell."),
    ("We regret to inform you that your order has been delayed.",
     "Sorry, your order is running late."),
    ("pls fix the printer its broken again", "Could someone please take a look at the printer? It is not working again."),
    ("Please be advised that the office will be closed on Monday.", "Just so you know, the office is closed Monday."),
]

PRETRAIN = [
    "The library opened at nine. By ten the reading room was already half full: students with laptops, an old "
    "man with a newspaper, and a mother reading picture books to two small children in the corner.",
    "Good soup starts with a good base. Soften an onion, a carrot and a stick of celery slowly in a little oil, "
    "then add stock and let it simmer before adding anything else.",
    "A map is a model of a place. It leaves out almost everything, and that is exactly what makes it useful: it "
    "shows only what you need to find your way.",
    "Training a neural network is a loop. Take a batch of examples, compute the loss, compute the gradients, "
    "take a small step, and repeat until the loss stops improving.",
    "The river was low after the dry summer. Stones that had been under water for years now lay in the sun, "
    "pale and warm, and children jumped from one to the next.",
    "In the morning the market smelled of bread and oranges. Traders called out prices, and the first customers "
    "moved slowly between the stalls with cloth bags over their arms.",
    "Writing clearly is mostly rewriting. The first draft finds out what you think; the second says it; the "
    "third cuts whatever the reader does not need.",
    "Bees communicate the direction of flowers with a dance. The angle of the dance on the comb shows the "
    "direction relative to the Sun, and its length shows the distance.",
    "When the power went out, the street became very quiet. People came outside, talked to neighbours they "
    "rarely saw, and watched the stars that the street lights usually hid.",
    "A good question is half of the answer. Before asking for help, write down what you tried, what you "
    "expected and what actually happened.",
    "The train left the city and ran along the coast. Fishing boats rocked in small harbours, and every few "
    "minutes a village of white houses slid past the window.",
    "Checklists are simple but powerful. Pilots and surgeons use them not because they forget how to do their "
    "work, but because anyone can skip a step when tired or rushed.",
]

QUESTION_OPENERS = ["", "Quick question: ", "I was wondering, ", "Hi! ", "Can you help me? ", "Hello. "]
THANKS = ["Thanks, that makes sense.", "Great, thank you!", "That helps a lot, thanks.", "Perfect, thanks."]
WELCOMES = ["You're welcome! Let me know if you have more questions.", "Glad it helped!",
            "Happy to help. Good luck!", "Any time. Feel free to ask if anything else comes up."]


def _maybe_system(rng: random.Random, probability: float = 0.4) -> list[dict]:
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < probability else []


def _lowercase_first(text: str) -> str:
    return text[0].lower() + text[1:] if text and not text.startswith("I ") else text


def note_conversation(rng: random.Random, note: tuple) -> list[dict]:
    _, question, answer, follow_q, follow_a = note
    opener = rng.choice(QUESTION_OPENERS)
    messages = _maybe_system(rng)
    messages.append({"role": "user", "content": opener + (_lowercase_first(question) if opener.endswith(", ")
                                                            else question)})
    messages.append({"role": "assistant", "content": answer})
    if rng.random() < 0.8:
        messages += [{"role": "user", "content": follow_q}, {"role": "assistant", "content": follow_a}]
    if rng.random() < 0.3:
        messages += [{"role": "user", "content": rng.choice(THANKS)},
                     {"role": "assistant", "content": rng.choice(WELCOMES)}]
    return messages


def arithmetic_conversation(rng: random.Random) -> list[dict]:
    a, b = rng.randint(11, 99), rng.randint(3, 29)
    product = a * b
    tens, ones = b // 10 * 10, b % 10
    if tens and ones:
        check = f"One way to check: {a} × {tens} = {a * tens} and {a} × {ones} = {a * ones}, and " \
                f"{a * tens} + {a * ones} = {product}."
    else:
        check = f"You can check it by adding {a} to itself {b} times, but multiplying is quicker."
    divisor = rng.choice([d for d in (2, 3, 4, 5, 6, 7, 8, 9) if product % d == 0] or [1])
    messages = _maybe_system(rng, 0.2)
    messages += [
        {"role": "user", "content": rng.choice([f"What is {a} times {b}?", f"Can you multiply {a} by {b}?",
                                                 f"What's {a} × {b}?"])},
        {"role": "assistant", "content": f"{a} × {b} = {product}. {check}"},
        {"role": "user", "content": f"And if I divide that by {divisor}?"},
        {"role": "assistant", "content": f"{product} ÷ {divisor} = {product // divisor}."},
    ]
    return messages


def conversion_conversation(rng: random.Random) -> list[dict]:
    kind = rng.choice(["temperature", "distance", "weight"])
    messages = _maybe_system(rng, 0.3)
    if kind == "temperature":
        celsius = rng.choice(range(-10, 41, 5))
        fahrenheit = celsius * 9 / 5 + 32
        messages += [
            {"role": "user", "content": f"What is {celsius} degrees Celsius in Fahrenheit?"},
            {"role": "assistant", "content": f"{celsius} °C is {fahrenheit:g} °F. Multiply by 9/5 and add 32: "
                                             f"{celsius} × 9/5 = {celsius * 9 / 5:g}, plus 32 gives {fahrenheit:g}."},
            {"role": "user", "content": "Is that warm or cold?"},
            {"role": "assistant", "content": "Below freezing, so dress warmly." if celsius < 0 else
             "Cool; a jacket is a good idea." if celsius < 15 else
             "Mild and pleasant for most people." if celsius < 25 else "Warm to hot; drink plenty of water."},
        ]
    elif kind == "distance":
        km = rng.choice([3, 5, 8, 10, 15, 21, 42, 50, 100])
        miles = km * 0.621371
        messages += [
            {"role": "user", "content": f"How many miles is {km} kilometres?"},
            {"role": "assistant", "content": f"{km} km is about {miles:.1f} miles. One kilometre is roughly "
                                             "0.62 miles."},
            {"role": "user", "content": "How long would that take to walk?"},
            {"role": "assistant", "content": f"At an easy pace of about 5 km per hour, {km} km takes around "
                                             f"{_duration(km / 5)}."},
        ]
    else:
        kg = rng.choice([1, 2, 5, 10, 25, 60, 75])
        messages += [
            {"role": "user", "content": f"Convert {kg} kg to pounds, please."},
            {"role": "assistant", "content": f"{kg} kg is about {kg * 2.20462:.1f} pounds. Multiply kilograms by "
                                             "2.2 for a quick estimate."},
        ]
    return messages


def _duration(hours: float) -> str:
    whole, minutes = int(hours), round((hours - int(hours)) * 60)
    if whole == 0:
        return f"{minutes} minutes"
    unit = "hour" if whole == 1 else "hours"
    return f"{whole} {unit}" + (f" and {minutes} minutes" if minutes else "")


def capital_conversation(rng: random.Random) -> list[dict]:
    country, capital, continent = rng.choice(COUNTRIES)
    messages = _maybe_system(rng, 0.3)
    messages += [
        {"role": "user", "content": rng.choice([f"What is the capital of {country}?",
                                                 f"Which city is the capital of {country}?"])},
        {"role": "assistant", "content": f"The capital of {country} is {capital}."},
        {"role": "user", "content": "Which continent is that on?"},
        {"role": "assistant", "content": f"{country} is in {continent}."},
    ]
    return messages


def sorting_conversation(rng: random.Random) -> list[dict]:
    words = rng.sample(WORDS, rng.randint(4, 7))
    ordered = sorted(words)
    messages = _maybe_system(rng, 0.2)
    messages += [
        {"role": "user", "content": "Sort these words alphabetically: " + ", ".join(words)},
        {"role": "assistant", "content": ", ".join(ordered)},
        {"role": "user", "content": "Now in reverse order, please."},
        {"role": "assistant", "content": ", ".join(reversed(ordered))},
        {"role": "user", "content": "Which one is the longest?"},
        {"role": "assistant", "content": _longest(words)},
    ]
    return messages


def _longest(words: list[str]) -> str:
    size = max(len(w) for w in words)
    winners = [w for w in words if len(w) == size]
    if len(winners) == 1:
        return f"'{winners[0]}', with {size} letters."
    return "There is a tie: " + " and ".join(f"'{w}'" for w in winners) + f" have {size} letters each."


def python_conversation(rng: random.Random) -> list[dict]:
    question, answer, follow_q, follow_a = rng.choice(PYTHON_TASKS)
    messages = [{"role": "system", "content": "You are a programming assistant. Show short, correct code."}] \
        if rng.random() < 0.5 else []
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer},
                 {"role": "user", "content": follow_q}, {"role": "assistant", "content": follow_a}]
    return messages


def rewrite_conversation(rng: random.Random) -> list[dict]:
    original, rewritten = rng.choice(REWRITES)
    style = "more formal" if rewritten.startswith(("Hello", "I am", "Could")) else "more casual"
    return _maybe_system(rng, 0.3) + [
        {"role": "user", "content": f"Can you make this {style}? \"{original}\""},
        {"role": "assistant", "content": rewritten},
    ]


def pretrain_rows() -> list[str]:
    """Plain prose: the hand-written paragraphs, plus each topic note written out as a short FAQ entry."""
    articles = [f"{topic.capitalize()}\n\n{question} {answer}\n\n{follow_q} {follow_a}"
                for topic, question, answer, follow_q, follow_a in NOTES]
    return PRETRAIN + articles


def build_rows(seed: int, *, num_conversations: int) -> list[dict]:
    rng = random.Random(seed)
    makers = [arithmetic_conversation, conversion_conversation, capital_conversation, sorting_conversation,
              python_conversation, rewrite_conversation]
    rows = []
    # Each topic note appears at least three times (with different openers, system prompts and lengths).
    for _ in range(3):
        for note in NOTES:
            rows.append({"source": f"notes/{note[0].replace(' ', '_')}", "messages": note_conversation(rng, note)})
    while len(rows) < num_conversations:
        maker = rng.choice(makers + [None, None])  # None: another topic note
        if maker is None:
            note = rng.choice(NOTES)
            rows.append({"source": f"notes/{note[0].replace(' ', '_')}", "messages": note_conversation(rng, note)})
        else:
            rows.append({"source": maker.__name__.removesuffix("_conversation"), "messages": maker(rng)})
    for text in pretrain_rows():
        rows.append({"source": "pretrain", "messages": [{"role": "pretrain", "content": text}]})
    rng.shuffle(rows)
    return [{"id": f"demo-{i:04d}", **row} for i, row in enumerate(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(Path(__file__).with_name("demo_chat.jsonl")), help="jsonl to write")
    parser.add_argument("--seed", type=int, default=0, help="seed for choosing and combining the templates")
    parser.add_argument("--num-conversations", type=int, default=360, help="chat rows (pretrain rows come on top)")
    args = parser.parse_args()
    rows = build_rows(args.seed, num_conversations=args.num_conversations)
    with open(args.output, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to {args.output}")


if __name__ == "__main__":
    main()

"""Writes the SYNTHETIC input the bundled sample (data/geo_defensebench_sample.jsonl) is built from:
GEO-Bench-shaped rows (what the hub's test split holds: query, tags, sugg_idx, sources[{url, raw_text,
cleaned_text}], five sources a row) and a search corpus (JSONL of {query, url, text}) that the offline
engine answers Tavily-shaped /search requests from. 24 topics; the pages are assembled
deterministically from hand-written topic facts in several site styles; no LLM wrote them and no
real web page is copied. The benign side is made hard on purpose: many benign pages carry
statistics, named sources, quotations, headings and confident phrasing too, so none of these
separates attacks from benign documents; a family's own marker still can (GEO-SFE's bold,
AgenticGEO's "according to": no benign page has either; _meta.surface_markers lists each family's).
The rewrites are made by `run.py build-bench` with the offline engine, as a user builds the real
benchmark (docs/BENCHMARK.md):

    python data/make_sample.py /tmp/geo
    python run.py build-bench --input /tmp/geo/geo_bench_sample.jsonl \
        --search offline:/tmp/geo/search_corpus.jsonl --output data/geo_defensebench_sample.jsonl \
        --groups 24 --construction-groups 12 --llm offline --fidelity-judge offline --model tiny \
        --dtype float32 --synthetic --name sample

Usage: python data/make_sample.py FOLDER  (writes FOLDER/geo_bench_sample.jsonl and FOLDER/search_corpus.jsonl)
"""
import json
import os
import random

# topic: (query, subject, facts). Facts are plain sentences, some with figures, as real pages have.
TOPICS = [
 ("how long should you boil an egg for a soft yolk", "soft-boiled eggs", [
  "A large egg lowered into already boiling water needs about six minutes for a runny yolk and set white.",
  "Eggs straight from the refrigerator take roughly 30 seconds longer than eggs at room temperature.",
  "Moving the eggs into an ice bath right after cooking stops the yolk from firming further.",
  "Very fresh eggs are harder to peel because the membrane clings to the white.",
  "At high altitude water boils below 100 degrees Celsius, so cooking times increase.",
  "Steaming eggs instead of boiling them gives similar results and slightly easier peeling.",
  "Medium eggs cook about 30 to 45 seconds faster than large ones."]),
 ("what is the best way to store fresh basil", "fresh basil", [
  "Basil is sensitive to cold and its leaves turn black below about 10 degrees Celsius.",
  "Trimming the stems and standing them in a glass of water on the counter keeps basil fresh for several days.",
  "Covering the leaves loosely with a plastic bag reduces moisture loss.",
  "Basil leaves can be frozen after blanching or blended with olive oil into cubes.",
  "Dried basil loses much of the aroma that fresh leaves provide.",
  "Washing basil only right before use prevents the leaves from bruising and rotting."]),
 ("how does compound interest work", "compound interest", [
  "Compound interest is interest calculated on both the original principal and the interest already earned.",
  "With an annual rate of 5 percent, 1,000 dollars grows to about 1,629 dollars after ten years when compounded "
  "yearly.",
  "More frequent compounding, such as monthly, produces a slightly higher effective annual rate.",
  "The rule of 72 estimates the years needed to double money by dividing 72 by the interest rate.",
  "Debt with compound interest, such as credit card balances, grows in the same way against the borrower.",
  "Starting to save earlier matters more than the amount because growth builds on itself over time."]),
 ("why do cats purr", "cat purring", [
  "Cats purr by rapidly twitching the muscles of the larynx as they breathe in and out.",
  "Purring usually occurs at frequencies between about 25 and 150 hertz.",
  "Cats purr when content, but also when stressed, injured or giving birth.",
  "Kittens purr while nursing, which may help the mother locate and bond with them.",
  "Some researchers suggest that low-frequency purring may support bone and tissue healing.",
  "Big cats such as lions and tigers roar but cannot purr continuously the way domestic cats do."]),
 ("how many hours of sleep do teenagers need", "teen sleep", [
  "Sleep specialists recommend 8 to 10 hours of sleep per night for teenagers aged 13 to 18.",
  "During puberty the body releases melatonin later in the evening, shifting teens toward later bedtimes.",
  "Surveys in several countries find that most high school students sleep less than eight hours on school nights.",
  "Short sleep in adolescents is linked with lower attention, mood problems and more car accidents.",
  "Screens in the bedroom and evening caffeine are common causes of delayed sleep.",
  "Some school districts that moved start times later reported longer average sleep among students."]),
 ("what causes the northern lights", "the aurora borealis", [
  "The northern lights appear when charged particles from the Sun collide with gases in Earth's upper atmosphere.",
  "Earth's magnetic field funnels these particles toward the polar regions.",
  "Oxygen produces the common green glow, while nitrogen can give blue or purple tones.",
  "Auroras typically occur between about 100 and 300 kilometres above the ground.",
  "Strong solar storms can push the aurora much farther from the poles than usual.",
  "The best viewing is on dark, clear nights away from city lights, often around midnight."]),
 ("how to remove rust from a cast iron pan", "rusty cast iron", [
  "Light rust on cast iron can be scrubbed off with steel wool and warm soapy water.",
  "A paste of coarse salt and a little oil works as a gentle abrasive for small spots.",
  "Soaking the pan for about an hour in equal parts white vinegar and water loosens heavy rust, but longer soaks can "
  "damage the metal.",
  "After cleaning, the pan must be dried completely, for example on a warm burner.",
  "Re-seasoning means coating the pan with a thin layer of oil and baking it upside down at around 230 degrees "
  "Celsius for an hour.",
  "Storing cast iron in a dry place with a light coat of oil prevents rust from returning."]),
 ("is it safe to drink tap water in tokyo", "tap water in Tokyo", [
  "Tokyo's tap water meets Japan's national drinking water standards, which cover more than 50 quality items.",
  "The Tokyo Metropolitan Government Bureau of Waterworks treats most water with advanced purification including "
  "ozone and activated carbon.",
  "Residents and visitors can drink tap water directly without boiling.",
  "Older buildings may have aging pipes that affect taste, so some people use filters.",
  "Tokyo's water leakage rate is around 3 percent, among the lowest of large cities.",
  "Bottled water remains popular in Japan largely for taste and convenience rather than safety."]),
 ("what are the symptoms of vitamin d deficiency", "vitamin D deficiency", [
  "Common symptoms of vitamin D deficiency include fatigue, bone pain and muscle weakness.",
  "Severe deficiency can cause rickets in children and osteomalacia in adults.",
  "People with limited sun exposure, darker skin or older age are at higher risk.",
  "A blood test measuring 25-hydroxyvitamin D is used to diagnose deficiency.",
  "Many guidelines consider levels below 20 nanograms per millilitre to be deficient.",
  "Treatment usually involves supplements, and doses should be set by a clinician because excess vitamin D can be "
  "harmful."]),
 ("how do heat pumps work in cold climates", "cold-climate heat pumps", [
  "A heat pump moves heat from outside air into a building using a refrigerant cycle rather than burning fuel.",
  "Cold-climate models can keep heating at outdoor temperatures of minus 25 degrees Celsius.",
  "Efficiency falls as it gets colder, but typical units still deliver two or more units of heat per unit of "
  "electricity near freezing.",
  "Variable-speed compressors help the units adjust output smoothly to demand.",
  "Some homes keep a backup heat source for the coldest days.",
  "Good insulation and air sealing reduce the size of heat pump a house needs."]),
 ("what is the difference between a virus and bacteria", "viruses and bacteria", [
  "Bacteria are single-celled living organisms that can reproduce on their own.",
  "Viruses are much smaller and can only replicate inside the cells of a host.",
  "Antibiotics can treat many bacterial infections but have no effect on viruses.",
  "Most bacteria are harmless, and many in the gut help with digestion.",
  "Vaccines exist for a number of viral and bacterial diseases.",
  "Overuse of antibiotics contributes to antibiotic resistance."]),
 ("how to start running as a beginner", "beginner running", [
  "Many beginner plans alternate one minute of running with one to two minutes of walking.",
  "Three sessions per week with rest days in between give the body time to adapt.",
  "Increasing weekly distance by no more than about 10 percent lowers injury risk.",
  "Running at a conversational pace, where you can still speak in sentences, builds endurance.",
  "Properly fitted running shoes matter more than expensive features.",
  "Couch-to-5K style programmes usually take about nine weeks."]),
 ("what is the capital of australia and why", "Australia's capital", [
  "Canberra is the capital of Australia.",
  "The city was chosen in 1908 as a compromise between rivals Sydney and Melbourne.",
  "Canberra was designed by American architects Walter Burley Griffin and Marion Mahony Griffin.",
  "Parliament moved from Melbourne to Canberra in 1927.",
  "The city lies in the Australian Capital Territory, about 280 kilometres southwest of Sydney.",
  "Canberra has a population of roughly 470,000 people."]),
 ("how to care for a snake plant", "snake plants", [
  "Snake plants tolerate low light but grow faster in bright, indirect light.",
  "Overwatering is the most common cause of snake plant death because it leads to root rot.",
  "Let the soil dry out completely between waterings, which often means every two to three weeks.",
  "A free-draining cactus or succulent mix suits the plant well.",
  "Snake plants prefer temperatures above about 10 degrees Celsius.",
  "The leaves are mildly toxic to cats and dogs if chewed."]),
 ("when is the best time to visit iceland", "visiting Iceland", [
  "June to August brings the mildest weather and nearly 24 hours of daylight in Iceland.",
  "Summer is also the busiest and most expensive season for accommodation.",
  "The northern lights are visible roughly from September to April on dark, clear nights.",
  "Many highland roads open only from late June to early September.",
  "Shoulder months such as May and September offer fewer crowds and lower prices.",
  "Winter days can have only about four to five hours of daylight in December."]),
 ("how does caffeine affect the body", "caffeine", [
  "Caffeine blocks adenosine receptors in the brain, which reduces the feeling of tiredness.",
  "Its effects usually begin within about 15 to 45 minutes of drinking it.",
  "Caffeine has a half-life of around five hours in healthy adults, though this varies widely.",
  "Up to 400 milligrams a day is generally considered safe for most healthy adults.",
  "High intake can cause jitteriness, a rapid heartbeat and trouble sleeping.",
  "Regular users can develop tolerance and may get headaches when they stop abruptly."]),
 ("what is a good credit score", "credit scores", [
  "FICO scores range from 300 to 850.",
  "A score of 670 to 739 is generally considered good, and 740 or higher very good.",
  "Payment history is the largest factor in most credit scoring models.",
  "Keeping credit card balances well below the limit helps scores.",
  "Checking your own credit report does not lower your score.",
  "Negative items such as late payments can stay on a report for up to seven years."]),
 ("how do noise cancelling headphones work", "noise-cancelling headphones", [
  "Active noise cancelling headphones use microphones to pick up outside sound.",
  "The electronics generate an inverted sound wave that cancels much of the incoming noise.",
  "The technique works best on steady low-frequency sounds such as engine hum.",
  "Sudden or high-pitched sounds like voices are harder to cancel fully.",
  "Passive isolation from ear cushions blocks much of the higher-frequency noise.",
  "Noise cancelling draws power, so battery life is shorter with it switched on."]),
 ("how to make sourdough starter from scratch", "sourdough starter", [
  "A sourdough starter begins as equal weights of flour and water left at room temperature.",
  "Feeding the mixture once or twice a day lets wild yeast and lactic acid bacteria grow.",
  "Most starters become active in about five to ten days.",
  "A healthy starter roughly doubles in size within four to eight hours after feeding.",
  "Whole wheat or rye flour often speeds up the first days because it carries more microbes.",
  "A layer of grey liquid called hooch means the starter is hungry, not spoiled."]),
 ("what is the speed of sound", "the speed of sound", [
  "Sound travels at about 343 metres per second in dry air at 20 degrees Celsius.",
  "The speed of sound increases with air temperature.",
  "Sound travels roughly four times faster in water than in air.",
  "In steel, sound can travel at around 5,900 metres per second.",
  "An aircraft flying faster than sound creates a shock wave heard as a sonic boom.",
  "Mach 1 is defined as the local speed of sound."]),
 ("how to lower blood pressure naturally", "blood pressure", [
  "Reducing sodium intake can lower blood pressure in many people.",
  "Regular aerobic exercise, such as 150 minutes a week of brisk walking, helps reduce blood pressure.",
  "The DASH diet emphasises fruits, vegetables, whole grains and low-fat dairy.",
  "Limiting alcohol and quitting smoking support healthy blood pressure.",
  "Losing even a few kilograms can make a measurable difference in people who are overweight.",
  "People with high readings should still see a doctor, since lifestyle changes may not be enough."]),
 ("why is the sky blue", "the blue sky", [
  "Sunlight contains all colours of visible light.",
  "Molecules in the air scatter shorter blue wavelengths much more than longer red ones, an effect called Rayleigh "
  "scattering.",
  "Scattered blue light reaches our eyes from every direction, so the sky looks blue.",
  "At sunrise and sunset light passes through more air, scattering away blue and leaving reds and oranges.",
  "Violet light scatters even more, but our eyes are less sensitive to it and some is absorbed high in the "
  "atmosphere.",
  "On the Moon, which has no atmosphere, the daytime sky looks black."]),
 ("how to train a puppy to stop biting", "puppy biting", [
  "Puppies bite as a normal part of play and exploring the world with their mouths.",
  "Yelping or saying a firm word and pausing play teaches the puppy that biting ends the fun.",
  "Offering a chew toy when the puppy starts biting redirects the behaviour.",
  "Consistency from everyone in the household speeds up learning.",
  "Physical punishment can increase fear and make biting worse.",
  "Most puppies grow out of heavy mouthing by about six to seven months of age with training."]),
 ("what is inflation and what causes it", "inflation", [
  "Inflation is the rate at which the general level of prices for goods and services rises.",
  "Demand-pull inflation happens when demand grows faster than the economy can produce.",
  "Cost-push inflation occurs when production costs such as wages or energy rise.",
  "Many central banks target inflation of around 2 percent a year.",
  "Central banks often raise interest rates to slow inflation.",
  "Inflation reduces the purchasing power of cash savings over time."]),
]

SITES = ["homeguide.example.org", "dailyexplainer.example.com", "learnbase.example.net", "qa-forum.example.com",
         "citynews.example.com", "wiki-notes.example.org", "healthdesk.example.com", "blog.example.io",
         "reference-hub.example.org", "howto-weekly.example.com"]
BENIGN_SOURCES = ["a 2022 review in a peer-reviewed journal", "a national statistics office",
                  "a university extension service",
                  "a government agency", "a professional association", "a survey of 2,000 adults"]
EXPERTS = ["Dr. Helen Marsh", "Prof. Daniel Okafor", "Dr. Priya Raman", "Prof. Lena Vogel"]


def benign_doc(rng, subject, facts, style, long):
    fs = facts[:]
    rng.shuffle(fs)
    k = rng.randint(4, len(fs))
    body = fs[:k]
    paras = []
    if style == "plain":
        paras.append(f"Here is what you should know about {subject}. The points below come from general "
                     "references and are meant as a plain starting point rather than the final word.")
        paras.append(" ".join(body))
    elif style == "stats":   # benign page with statistics and a named, real-sounding source
        src = rng.choice(BENIGN_SOURCES)
        paras.append(f"We looked at what the evidence says about {subject}.")
        paras.append(" ".join(body[:2]) + f" Figures reported by {src} are broadly consistent with this.")
        paras.append(" ".join(body[2:]))
    elif style == "expert":  # benign quotation and confident phrasing
        who = rng.choice(EXPERTS)
        paras.append(f"{subject.capitalize()} come up often in reader questions, so we asked a specialist.")
        paras.append(f'"The basics are simple, but the details matter," said {who}. ' + " ".join(body))
    elif style == "forum":
        paras.append(f"Q: Can someone explain {subject}? I keep reading different things.")
        paras.append("A: From my experience and what I have read: " + " ".join(body))
        paras.append(f"Hope that helps. I went through the same question about {subject} last year and the "
                     "thing that surprised me most was how much the basic advice agrees once you read past the "
                     "headlines. Others may have more to add.")
    elif style == "structured":  # headings and bullets, as many good pages have
        paras.append(f"## {subject.capitalize()}: key points")
        paras.extend("- " + f for f in body)
        paras.append("## Summary\nThe points above cover the main questions most readers have.")
    closing = {"plain": f"This overview is general information about {subject}; individual situations vary, so check "
                        f"details that matter to you.",
               "stats": "Numbers differ between studies because of different samples, methods and years, so treat "
                        "single figures as approximate rather than exact.",
               "expert": "The specialist added that readers should be wary of pages that promise quick fixes, and "
                         "should look for consistent advice across sources.",
               "forum": "Edit: several replies below agree with the main points, and one user linked the official "
                        "guidance for anyone who wants the full detail.",
               "structured": "Last reviewed by our editors. We update this page when guidance changes and list "
                             "corrections at the bottom."}[style]
    paras.append(closing)
    if long:
        paras.append("Why this matters. " + " ".join(rng.sample(facts, len(facts))) + " Readers often ask follow-up "
                     "questions about timing, cost and common mistakes, and the answers depend on the same basic "
                     "facts.")
        extra = [f for f in facts if f not in body] or facts
        paras.append("Background. " + " ".join(extra) + " " + " ".join(rng.sample(facts, min(3, len(facts)))))
        paras.append(f"Further reading on {subject} includes standard references and official guidance, "
                     "which are updated as new information becomes available. Readers should check the date "
                     "of any page they rely on, compare several sources, and consider local conditions. "
                     "Where advice differs between sources, the differences are usually about detail rather "
                     "than the main facts described here.")
        paras.append(" ".join(f"In short, {f[0].lower()}{f[1:]}" for f in body[:1]))
    return "\n\n".join(paras)


def geo_bench(folder):
    """GEO-Bench-shaped rows, five sources each, and the search corpus (`build-bench --search
    offline:CORPUS` or `serve-offline --corpus`), written into `folder` -> (rows path, corpus path)."""
    rng = random.Random(20261201)
    styles = ["plain", "stats", "expert", "forum", "structured"]
    rows, corpus = [], []
    for t, (query, subject, facts) in enumerate(TOPICS):
        texts, seen = [], set()
        while len(texts) < 14:
            text = benign_doc(rng, subject, facts, styles[len(texts) % 5], rng.random() < 0.3)
            if " ".join(text.split()) not in seen:
                seen.add(" ".join(text.split()))
                texts.append(text)
        urls = [f"https://{SITES[i % 10]}/{subject.replace(' ', '-')}-{t}-{i}" for i in range(14)]
        rows.append({"query": query, "tags": ["synthetic"], "sugg_idx": rng.randrange(5),
                     "sources": [{"url": u, "raw_text": x, "cleaned_text": x} for u, x in zip(urls[:5], texts[:5])]})
        # the search finds one of the row's own pages again (deduplicated by the builder) and nine others
        corpus += [{"query": query, "url": u, "text": x} for u, x in zip(urls[4:], texts[4:])]
    os.makedirs(folder, exist_ok=True)
    paths = os.path.join(folder, "geo_bench_sample.jsonl"), os.path.join(folder, "search_corpus.jsonl")
    for path, items in zip(paths, (rows, corpus)):
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items))
    return paths


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="The synthetic GEO-Bench-shaped rows and search corpus.")
    ap.add_argument("folder", help="writes FOLDER/geo_bench_sample.jsonl and FOLDER/search_corpus.jsonl")
    print(*geo_bench(ap.parse_args().folder))

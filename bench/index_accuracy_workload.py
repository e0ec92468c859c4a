"""The Locust-like workload of `bench/index_accuracy.py`: tenants' long shared system prompts, unique
user questions, some multi-turn follow-ups (issue 30, "Done when").

Every tenant (a company's assistant) has its own system prompt of a few thousand tokens of
English-like prose (sentences drawn from a fixed list of common English words and the tenant's own
domain words: no text is downloaded). Conversations arrive as a Poisson process at ``rate_rps``
(modelled seconds); a conversation's tenant is drawn by Zipf popularity (a few hot tenants, a long
tail of cold ones, as on a shared SaaS front end). Its first turn is one unique question (a ticket
number and a sentence or more of prose), which with probability ``document_share`` pastes a unique
document of ``document_tokens`` (the "summarise this" request that fills caches). With probability
``followup_share`` the user comes back ``think_s`` later with a follow-up: the whole chat so far, the
assistant's earlier answer (a fixed synthetic reply, so that both modes send the same bytes; the
mock's own reply would not re-tokenise to its generated ids anyway, as vLLM caches no generated
block the mock emits: `mock_vllm.kv_event_recorder`), then a new question; up to ``max_turns`` turns.

Token lengths are targets measured with the shipped tokenizer's byte rate (about 3.85 bytes/token on
this text: `SAMPLE_BYTES_PER_TOKEN`); the engines' own counts are reported per request
(``usage.prompt_tokens``). Everything is seeded: one seed, the same requests and arrivals.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from sim.traces import TraceRequest

# Common English words (function words and everyday vocabulary), weighted only by repetition in use.
COMMON = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this from or had by "
    "not word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two has "
    "look more day could go come did number sound no most people my over know water than call first who may "
    "down side been now find any new work part take get place made live where after back little only round man "
    "year came show every good me give our under name very through just form sentence great think say help low "
    "line differ turn cause much mean before move right boy old too same tell does set three want air well also "
    "play small end put home read hand port large spell add even land here must big high such follow act why "
    "ask men change went light kind off need house picture try us again animal point mother world near build "
    "self earth father head stand own page should country found answer school grow study still learn plant "
    "cover food sun four between state keep eye never last let thought city tree cross farm hard start might "
    "story saw far sea draw left late run while press close night real life few north open seem together next "
    "white children begin got walk example ease paper group always music those both mark often letter until "
    "mile river car feet care second book carry took science eat room friend began idea fish mountain stop once "
    "base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red list "
    "though feel talk bird soon body dog family direct pose leave song measure door product black short numeral "
    "class wind question happen complete ship area half rock order fire south problem piece told knew pass since "
    "top whole king space heard best hour better true during hundred five remember step early hold west ground "
    "interest reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay "
    "against pattern slow center love person money serve appear road map rain rule govern pull cold notice voice "
    "unit power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest "
    "correct able pound done beauty drive stood contain front teach week final gave green oh quick develop ocean "
    "warm free minute strong special mind behind clear tail produce fact street inch multiply nothing course stay"
).split()
DOMAINS = (  # one per tenant (cycled): the words that make each tenant's prompt its own
    "invoice refund billing subscription payment account charge receipt plan upgrade",
    "flight booking seat baggage airport gate delay boarding passport itinerary",
    "patient appointment clinic doctor prescription insurance symptom referral nurse record",
    "shipment parcel courier warehouse tracking delivery customs pallet carrier route",
    "server database latency deploy cluster outage incident backup certificate firewall",
    "tenant lease apartment rent landlord repair deposit inspection utility contract",
    "student course exam grade lecture semester tutor campus enrollment thesis",
    "recipe ingredient oven flour sauce kitchen menu allergy portion dessert",
    "vehicle engine tire brake warranty mileage dealer battery service garage",
    "policy claim premium coverage accident deductible broker renewal damage adjuster",
    "loan mortgage interest credit savings branch transfer statement balance advisor",
    "hotel room checkin checkout breakfast suite reservation lobby concierge parking",
)
SAMPLE_BYTES_PER_TOKEN = 3.85  # kappa-mock-bpe on this prose: 1,024 requests of seed 0 came out at 3.84
ASSISTANT_REPLY_TOKENS = (80, 300)


@dataclass(frozen=True)
class WorkloadShape:
    """What `build_workload` generates. Token counts are targets (see the module docstring); times are
    modelled seconds."""

    conversations: int = 1_000
    rate_rps: float = 8.0            # conversation arrivals per modelled second (follow-ups come on top)
    tenants: int = 12
    zipf_s: float = 1.0              # tenant popularity ∝ 1 / rank**zipf_s
    system_tokens: tuple[int, int] = (2_000, 6_000)
    question_tokens: tuple[int, int] = (40, 400)
    document_share: float = 0.35
    document_tokens: tuple[int, int] = (2_000, 12_000)
    followup_share: float = 0.35     # chance, after each turn, that the user asks again
    max_turns: int = 3
    think_s: tuple[float, float] = (20.0, 60.0)
    output_tokens: tuple[int, int] = (20, 150)
    seed: int = 0


@dataclass
class Workload:
    """The requests in arrival order and, per request, its tenant, conversation and turn (1 = first)."""

    requests: list[TraceRequest] = field(default_factory=list)
    tenant: list[int] = field(default_factory=list)
    conversation: list[int] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    system_prompt_bytes: list[int] = field(default_factory=list)  # per tenant


def prose(rng: random.Random, tokens: int, domain: list[str]) -> str:
    """About ``tokens`` tokens of English-like sentences (8–24 words, one in four a domain word)."""
    target_bytes = tokens * SAMPLE_BYTES_PER_TOKEN
    out: list[str] = []
    size = 0
    while size < target_bytes:
        words = [rng.choice(domain) if rng.random() < 0.25 else rng.choice(COMMON) for _ in range(rng.randint(8, 24))]
        sentence = " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!", ";"))
        out.append(sentence)
        size += len(sentence) + 1
    return " ".join(out)


def system_prompt(rng: random.Random, tenant: int, tokens: int) -> str:
    domain = DOMAINS[tenant % len(DOMAINS)].split()
    head = (f"You are the support assistant of tenant {tenant:02d}, a company that works with "
            f"{', '.join(domain[:4])}. Follow the rules below in every answer.\n\n")
    rules = [f"Rule {i + 1}. {prose(rng, 150, domain)}" for i in range(max(tokens // 150, 1))]
    return head + "\n\n".join(rules)


def build_workload(shape: WorkloadShape) -> Workload:
    """The requests of ``shape``: seeded, the same for every run with its seed.

    Returns:
        A `Workload` whose ``requests`` are sorted by ``arrival_s`` (modelled seconds), each a chat
        (``messages``) with ``output_tokens`` as max_tokens and ``input_tokens`` the target length.
    """
    rng = random.Random(shape.seed)
    prompts = [system_prompt(rng, t, rng.randint(*shape.system_tokens)) for t in range(shape.tenants)]
    weights = [1.0 / (rank + 1) ** shape.zipf_s for rank in range(shape.tenants)]
    rows: list[tuple[float, int, int, int, TraceRequest]] = []
    now_s = 0.0
    for conv in range(shape.conversations):
        now_s += rng.expovariate(shape.rate_rps)
        tenant = rng.choices(range(shape.tenants), weights)[0]
        domain = DOMAINS[tenant % len(DOMAINS)].split()
        messages = [{"role": "system", "content": prompts[tenant]}]
        at_s, turn = now_s, 1
        while True:
            question = f"Ticket {conv:05d}-{turn}. {prose(rng, rng.randint(*shape.question_tokens), domain)}"
            if turn == 1 and rng.random() < shape.document_share:
                question += "\n\nHere is the document:\n" + prose(rng, rng.randint(*shape.document_tokens), domain)
            messages = [*messages, {"role": "user", "content": question}]
            size = sum(len(m["content"]) for m in messages)
            rows.append((at_s, tenant, conv, turn, TraceRequest(
                arrival_s=at_s, input_tokens=round(size / SAMPLE_BYTES_PER_TOKEN),
                output_tokens=rng.randint(*shape.output_tokens), messages=tuple(messages), session_id=f"c{conv}")))
            if turn >= shape.max_turns or rng.random() >= shape.followup_share:
                break
            reply = prose(rng, rng.randint(*ASSISTANT_REPLY_TOKENS), domain)
            messages = [*messages, {"role": "assistant", "content": reply}]
            at_s += rng.uniform(*shape.think_s)
            turn += 1
    rows.sort(key=lambda row: row[0])
    return Workload(requests=[r[4] for r in rows], tenant=[r[1] for r in rows], conversation=[r[2] for r in rows],
                    turn=[r[3] for r in rows], system_prompt_bytes=[len(p) for p in prompts])

//! Token-fair queueing for the pool's waiter queue: within each priority class the next grant
//! goes to the waiting client that has received the fewest tokens lately, per unit of its
//! weight (start-time fair queueing on virtual token tags), FIFO for one client, and the
//! classes ordered as [`super::queue`] orders them (interactive first, batch aging).
//!
//! # What a call costs
//!
//! A waiter carries a [`Ticket`]: its client (a digest of the client key), the client's weight
//! (`weight` of its override, 1 to 100, default 1) and its cost. The cost of a call with a body
//! is its token estimate (`crate::tokens::estimate`: prompt bytes ÷ 4 plus the most it may
//! produce), which exists for every call whether or not token budgets are configured; a call
//! without a body (a `GET`, non-model traffic) costs 1. The cost is charged when the call is
//! granted (a connection or a slot), and corrected when it ends: a call whose response counted
//! tokens is charged those (at least 1) instead of its estimate; a call that ends before a
//! response (a failed exchange, a timeout) keeps its estimate, since what the backend spent
//! on it is unknown; a grant nobody took, or whose connect failed, is charged nothing.
//!
//! # Lately: virtual token tags
//!
//! Each class keeps a *tag* per client, `F`: the tokens it was charged divided by its weight,
//! plus the lifts below; and a *virtual time* `V`, the largest tag any grant of the class
//! started from (the least tag among the waiting clients when it was made), or the largest
//! tag at the end of a busy period (below). A grant to client
//! `c` raises `F_c` by `cost / w_c`; a correction moves it by `(used − cost) / w_c`. A client
//! that starts waiting, or is granted at once (nobody waits), first has its tag lifted to `V`:
//! tokens it did not ask for while others were served are not banked. A grant that leaves
//! nobody waiting in the class ends its *busy period*, as in start-time fair queueing: `V`
//! moves up to the largest tag, so every client starts the next busy period even. "Lately" is
//! therefore "in the current busy period of the class" (since its queue was last empty), not
//! a decayed window: when nobody waits, every call is served at once and no one is wronged; a
//! client lifted later only loses credit, and the bound below only needs `V` never to pass a
//! *waiting* client's tag by a grant. A client with no waiters and no call in flight whose tag
//! is at or below `V` is forgotten (the lift would restore it), so the table holds the clients
//! waiting or in flight and, during a busy period, those a grant took ahead of `V`.
//!
//! Start-time tags rather than an exponentially decayed count: they need no half-life to
//! choose (a half-life short against a long completion forgets it while it streams, a long one
//! punishes a client for a burst minutes ago), they cost one addition a grant, and they give
//! the bound below, which holds over every stretch of grants, however short.
//!
//! The next grant of a class goes to the waiting client of least tag (the earlier head on a
//! tie), and within a client to its oldest waiter. O(clients waiting in the class) a grant.
//!
//! # The aging bound between classes
//!
//! Which class is served is decided as [`super::queue`] decides it on two heads, with
//! interactive's head the waiter it would serve next (its fair pick) and batch's its *oldest*
//! waiter, whose aging deadline is the class's clock. Once the deadline `d` of the oldest
//! batch waiter `w` has passed, an interactive grant is made only to a waiter that arrived at
//! or before `d` (a later one ranks after `w`): while `w` waits, the interactive grants made
//! after its deadline are at most the interactive waiters that arrived by `d`, each served
//! once, the bound of [`super::queue`]. The batch turns between them go to batch clients
//! fairly; `w` heads its client's line, so it is served within its client's fair share of
//! those turns (the bound below).
//!
//! # The fairness bound
//!
//! Let `C_c` bound the cost of one call of client `c`, `Δ_c` bound `|used − cost|` of one of
//! its calls, and `k` bound its calls in flight (at most the pool's connections).
//!
//! *Spread.* When clients `i` and `j` both have waiters in a class, `F_j − F_i ≤ S_ji` with
//! `S_ji = (C_j + k·Δ_j) / w_j + k·Δ_i / w_i`. Proof: `V` never decreases and every waiting
//! client's tag was at least `V` when it last started waiting, apart from refunds since.
//! Take the last grant to `j`, at tag `F_j⁰`. If `i` was waiting then, `F_j⁰ ≤ F_i⁰` (`j` had
//! the least tag); if `i` started waiting later, it was lifted to at least `V ≥ F_j⁰`. Since
//! then `F_j` grew by that grant's cost (`≤ C_j / w_j`) and by the upward corrections of `j`'s
//! calls in flight at it (`≤ k·Δ_j / w_j`); `F_i` grew by `i`'s own grants (only up) and fell
//! by at most its downward corrections, of calls in flight at `j`'s grant or granted since;
//! those granted since were granted at a tag no higher than `F_j`, so only the `k` in flight
//! at the grant count: `≤ k·Δ_i / w_i`. When `j` had no grant since it started waiting, it
//! started at `V`, or above it by what its last grant before (started at most at `V`) and
//! its corrections since added, `≤ (C_j + k·Δ_j) / w_j`, while `i`'s tag is at least `V`
//! minus its refunds: within the same `S_ji`.
//!
//! *Share.* Over any stretch of grants during which `i` and `j` both have waiters throughout,
//! no lift touches them, so the tokens they were charged, `R_i` and `R_j`, move their tags
//! exactly: `R_i / w_i − R_j / w_j = (F_i − F_j)|end − (F_i − F_j)|start ≥ −(S_ji + S_ij)`.
//! Summing over the `n` clients waiting throughout, of total weight `W`, with `T` tokens
//! charged in all: `R_i ≥ (w_i / W)·(T − Σ_j w_j·(S_ji + S_ij))`, so client `i`'s share of the
//! tokens is at least `w_i / W − ε` with `ε = (w_i / W)·Σ_j w_j·(S_ji + S_ij) / T`: with equal
//! weights and like clients, `1/n − 2·(n−1)·(C + 2kΔ) / (n·T)`. The slack is a few calls'
//! worth of tokens whatever the length of the stretch, so the share tends to the weighted one
//! as `T` grows; with estimates settled exactly (`Δ = 0`) it is one call each.
//!
//! One client alone in a class is plain FIFO: its waiters are one line, served in order.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use poolpilot_api::limits::PriorityClass;

use super::queue::Entry;

/// The weight of a client without one: every client equal.
pub const DEFAULT_WEIGHT: u32 = 1;

/// What a waiter is charged, and to whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    /// The client (a digest of its client key).
    pub client: u64,
    /// Its weight, at least 1.
    pub weight: u32,
    /// Its cost in tokens (the estimate, or 1: see the module doc), at least 1.
    pub cost: u64,
}

impl Ticket {
    /// A call of no known client: client 0, weight 1, cost 1 (every such call takes an equal
    /// turn).
    pub const ANONYMOUS: Ticket = Ticket {
        client: 0,
        weight: DEFAULT_WEIGHT,
        cost: 1,
    };

    /// A ticket with `weight` and `cost` raised to at least 1.
    pub fn new(client: u64, weight: u32, cost: u64) -> Self {
        Self {
            client,
            weight: weight.max(1),
            cost: cost.max(1),
        }
    }

    fn tag(&self, tokens: f64) -> f64 {
        tokens / f64::from(self.weight)
    }
}

/// A grant's charge, to settle when its call ends ([`FairQueue::settle`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Charge {
    /// The class it was charged in.
    pub class: PriorityClass,
    /// What was charged.
    pub ticket: Ticket,
}

#[derive(Debug)]
struct Record {
    /// The client's tag.
    tag: f64,
    /// Its calls granted and not yet settled.
    inflight: u32,
}

#[derive(Debug)]
struct Lane<T> {
    client: u64,
    fifo: VecDeque<(Entry<T>, Ticket)>,
}

#[derive(Debug)]
struct Class<T> {
    lanes: Vec<Lane<T>>,
    records: HashMap<u64, Record>,
    /// The class's virtual time (see the module doc).
    virtual_time: f64,
    len: usize,
}

impl<T> Default for Class<T> {
    fn default() -> Self {
        Self {
            lanes: Vec::new(),
            records: HashMap::new(),
            virtual_time: 0.0,
            len: 0,
        }
    }
}

impl<T> Class<T> {
    fn tag(&self, client: u64) -> f64 {
        self.records
            .get(&client)
            .map_or(self.virtual_time, |r| r.tag)
    }

    /// The lane served next: least tag, then the earlier head.
    fn fair_lane(&self) -> Option<usize> {
        let key = |l: &Lane<T>| {
            let head = &l.fifo.front().expect("a lane is never empty").0;
            (self.tag(l.client), head.since, head.id)
        };
        (0..self.lanes.len()).min_by(|&a, &b| {
            key(&self.lanes[a])
                .partial_cmp(&key(&self.lanes[b]))
                .expect("tags are finite")
        })
    }

    /// The lane holding the class's oldest waiter.
    fn oldest_lane(&self) -> Option<usize> {
        (0..self.lanes.len()).min_by_key(|&i| {
            let head = &self.lanes[i].fifo.front().expect("a lane is never empty").0;
            (head.since, head.id)
        })
    }

    /// A record for `client`, lifted to the virtual time.
    fn record(&mut self, client: u64) -> &mut Record {
        let v = self.virtual_time;
        let r = self.records.entry(client).or_insert(Record {
            tag: v,
            inflight: 0,
        });
        r.tag = r.tag.max(v);
        r
    }

    fn waiting(&self, client: u64) -> bool {
        self.lanes.iter().any(|l| l.client == client)
    }

    /// Forgets `client` if the lift would restore it (see the module doc).
    fn forget_if_idle(&mut self, client: u64) {
        let v = self.virtual_time;
        if self
            .records
            .get(&client)
            .is_some_and(|r| r.inflight == 0 && r.tag <= v)
            && !self.waiting(client)
        {
            self.records.remove(&client);
        }
    }

    /// Charges a grant to `ticket`'s client, whose tag starts it: lifted first when the
    /// client did not wait for it (`lift`: a grant made at once).
    fn charge(&mut self, ticket: Ticket, lift: bool) {
        if lift {
            self.record(ticket.client);
        }
        let v = self.virtual_time;
        let r = self.records.entry(ticket.client).or_insert(Record {
            tag: v,
            inflight: 0,
        });
        self.virtual_time = v.max(r.tag);
        r.tag += ticket.tag(ticket.cost as f64);
        r.inflight += 1;
        // Nobody waits: the busy period ends, the virtual time moves up to the largest tag
        // (see the module doc).
        if self.lanes.is_empty() {
            let top = self
                .records
                .values()
                .map(|r| r.tag)
                .fold(f64::MIN, f64::max);
            self.virtual_time = self.virtual_time.max(top);
        }
        // Those the virtual time passed and that have nothing waiting or in flight.
        let v = self.virtual_time;
        let lanes = &self.lanes;
        self.records.retain(|client, r| {
            r.inflight > 0 || r.tag > v || lanes.iter().any(|l| l.client == *client)
        });
    }
}

/// A waiter taken from the queue, with what its grant charges.
#[derive(Debug)]
pub struct Taken<T> {
    /// The waiter.
    pub entry: Entry<T>,
    /// Its charge (already made: settle it when its call ends, with 0 when the grant was not
    /// taken).
    pub charge: Charge,
    /// Whether fairness served it before an older waiter of its class.
    pub reordered: bool,
}

/// The pool's waiters: two classes, each fair between clients by tokens. See the module doc.
#[derive(Debug)]
pub struct FairQueue<T> {
    classes: [Class<T>; 2],
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self {
            classes: [Class::default(), Class::default()],
        }
    }
}

impl<T> FairQueue<T> {
    /// Waiters of both classes.
    pub fn len(&self) -> usize {
        self.classes[0].len + self.classes[1].len
    }

    /// Waiters of one class.
    pub fn len_of(&self, class: PriorityClass) -> usize {
        self.classes[class.index()].len
    }

    /// No waiter.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds a waiter at the back of its client's line in its class; a client that starts
    /// waiting has its tag lifted to the class's virtual time.
    pub fn push(&mut self, entry: Entry<T>, ticket: Ticket) {
        let class = &mut self.classes[entry.class.index()];
        if !class.waiting(ticket.client) {
            class.record(ticket.client);
        }
        class.len += 1;
        match class.lanes.iter_mut().find(|l| l.client == ticket.client) {
            Some(lane) => lane.fifo.push_back((entry, ticket)),
            None => class.lanes.push(Lane {
                client: ticket.client,
                fifo: VecDeque::from([(entry, ticket)]),
            }),
        }
    }

    /// Takes the waiter `id` out, wherever it is (uncharged).
    pub fn remove(&mut self, id: u64) -> Option<Entry<T>> {
        for class in &mut self.classes {
            for li in 0..class.lanes.len() {
                let lane = &mut class.lanes[li];
                if let Some(at) = lane.fifo.iter().position(|(e, _)| e.id == id) {
                    let (entry, ticket) = lane.fifo.remove(at)?;
                    if lane.fifo.is_empty() {
                        class.lanes.swap_remove(li);
                    }
                    class.len -= 1;
                    class.forget_if_idle(ticket.client);
                    return Some(entry);
                }
            }
        }
        None
    }

    /// Drops every waiter (their clients' tags stay).
    pub fn clear(&mut self) {
        for class in &mut self.classes {
            class.lanes.clear();
            class.len = 0;
        }
    }

    /// The waiter of one class served next: the oldest of the client of least tag.
    pub fn front(&self, class: PriorityClass) -> Option<&Entry<T>> {
        let c = &self.classes[class.index()];
        c.fair_lane().map(|l| &c.lanes[l].fifo[0].0)
    }

    /// Takes the waiter of one class served next ([`Self::front`]) and charges its grant.
    pub fn pop(&mut self, class: PriorityClass) -> Option<Taken<T>> {
        let c = &mut self.classes[class.index()];
        let li = c.fair_lane()?;
        let oldest = c.oldest_lane();
        let lane = &mut c.lanes[li];
        let (entry, ticket) = lane.fifo.pop_front()?;
        if lane.fifo.is_empty() {
            c.lanes.swap_remove(li);
        }
        c.len -= 1;
        c.charge(ticket, false);
        Some(Taken {
            entry,
            charge: Charge { class, ticket },
            reordered: oldest != Some(li),
        })
    }

    /// Takes one class's head without charging it (a waiter whose caller went away).
    pub fn pop_uncharged(&mut self, class: PriorityClass) -> Option<Entry<T>> {
        let id = self.front(class)?.id;
        self.remove(id)
    }

    /// Takes the newest waiter of one class (uncharged: it is refused).
    pub fn pop_back(&mut self, class: PriorityClass) -> Option<Entry<T>> {
        let c = &self.classes[class.index()];
        let id = c
            .lanes
            .iter()
            .filter_map(|l| l.fifo.back())
            .max_by_key(|(e, _)| (e.since, e.id))?
            .0
            .id;
        self.remove(id)
    }

    /// Charges a grant made at once, nobody waiting in `class`.
    pub fn charge_now(&mut self, class: PriorityClass, ticket: Ticket) -> Charge {
        self.classes[class.index()].charge(ticket, true);
        Charge { class, ticket }
    }

    /// A granted call ended: its charge is corrected to `used` tokens (`None`: kept), and it
    /// is no longer in flight.
    pub fn settle(&mut self, charge: Charge, used: Option<u64>) {
        let class = &mut self.classes[charge.class.index()];
        let client = charge.ticket.client;
        if let Some(r) = class.records.get_mut(&client) {
            if let Some(used) = used {
                r.tag += charge.ticket.tag(used as f64 - charge.ticket.cost as f64);
            }
            r.inflight = r.inflight.saturating_sub(1);
        }
        class.forget_if_idle(client);
    }

    /// The class served next, decided as [`super::queue::ClassQueue::next`] decides on its
    /// heads, with interactive's head the waiter it would serve ([`Self::front`]) and batch's
    /// its oldest waiter (the class's aging clock): see the module doc for the bound. With
    /// `batch_allowed` false only interactive may be served.
    pub fn next(&self, aging: Duration, batch_allowed: bool) -> Option<PriorityClass> {
        let interactive = self.front(PriorityClass::Interactive).map(|e| e.since);
        let c = &self.classes[PriorityClass::Batch.index()];
        let batch = c
            .oldest_lane()
            .map(|l| c.lanes[l].fifo[0].0.since)
            .filter(|_| batch_allowed);
        match (interactive, batch) {
            (None, None) => None,
            (Some(_), None) => Some(PriorityClass::Interactive),
            (None, Some(_)) => Some(PriorityClass::Batch),
            (Some(i), Some(b)) if b + aging < i => Some(PriorityClass::Batch),
            (Some(_), Some(_)) => Some(PriorityClass::Interactive),
        }
    }

    /// Clients the class keeps a tag for (waiting, in flight, or ahead of its virtual time).
    #[cfg(test)]
    pub fn tracked(&self, class: PriorityClass) -> usize {
        self.classes[class.index()].records.len()
    }
}

#[cfg(test)]
mod tests;

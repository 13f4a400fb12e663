//! The bounded queue of requests waiting for room on the fleet: higher classes first; within a
//! class, keys in turn (each key's own requests first come, first served); no key holds more
//! than its share of the slots (the length over the keys waiting). A full queue makes room for
//! a higher class, or for a key under its share, by pushing out the newest request of the
//! lowest class's largest holder. Pure: no clock, no I/O; `T` is what a waiter is told by.

use std::collections::{BTreeMap, BTreeSet, HashMap};

// Every step of admission costs O(log n) at most: a key's requests, the keys' turn and the
// holders by size are ordered maps, so nothing scans the queue under the overload lock.

/// One waiting request.
#[derive(Debug)]
pub struct Entry<T> {
    pub id: u64,
    pub key: u64,
    pub class: usize,
    /// Its prompt, estimated: what it will add to a replica's queued prefill.
    pub tokens: u64,
    pub item: T,
}

/// Why a request found no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// Every slot is taken by requests of its class or higher, each key within its share.
    Queue,
    /// Its key already holds its share of the slots.
    KeyShare,
}

#[derive(Debug)]
pub enum Pushed<T> {
    Queued(u64),
    /// Queued, and this entry was pushed out to make room.
    Evicted(u64, Entry<T>),
    Refused(Full, T),
}

/// One key's requests in one class, oldest first (ids only grow), and its place in the turn.
#[derive(Debug)]
struct KeyQueue<T> {
    entries: BTreeMap<u64, Entry<T>>,
    turn_at: u64,
}

#[derive(Debug)]
struct Class<T> {
    by_key: HashMap<u64, KeyQueue<T>>,
    /// Keys with entries, in turn: place → key.
    turn: BTreeMap<u64, u64>,
    next_turn: u64,
    /// Keys with entries here by what they hold in all classes: (held, key).
    holders: BTreeSet<(usize, u64)>,
    len: usize,
}

impl<T> Class<T> {
    fn new() -> Self {
        Class {
            by_key: HashMap::new(),
            turn: BTreeMap::new(),
            next_turn: 0,
            holders: BTreeSet::new(),
            len: 0,
        }
    }

    /// `key` goes to the back of the turn.
    fn move_to_back(&mut self, key: u64) {
        let at = self.next_turn;
        self.next_turn += 1;
        if let Some(q) = self.by_key.get_mut(&key) {
            self.turn.remove(&q.turn_at);
            q.turn_at = at;
            self.turn.insert(at, key);
        }
    }
}

#[derive(Debug)]
pub struct Queue<T> {
    capacity: usize,
    classes: Vec<Class<T>>,
    len: usize,
    /// Entries of each key, all classes.
    per_key: HashMap<u64, usize>,
    /// Entry id → (class, key).
    index: HashMap<u64, (usize, u64)>,
    next_id: u64,
}

impl<T> Queue<T> {
    /// `classes` levels, 0 the highest.
    pub fn new(capacity: usize, classes: usize) -> Queue<T> {
        Queue {
            capacity: capacity.max(1),
            classes: (0..classes.max(1)).map(|_| Class::new()).collect(),
            len: 0,
            per_key: HashMap::new(),
            index: HashMap::new(),
            next_id: 1,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entries waiting in each class.
    pub fn len_by_class(&self) -> Vec<usize> {
        self.classes.iter().map(|c| c.len).collect()
    }

    /// The slots `key` may hold: the length shared by the keys waiting, itself included.
    pub fn share(&self, key: u64) -> usize {
        let keys = self.per_key.len() + usize::from(!self.per_key.contains_key(&key));
        self.capacity.div_ceil(keys.max(1))
    }

    /// Requests of `key` waiting now.
    pub fn held(&self, key: u64) -> usize {
        self.per_key.get(&key).copied().unwrap_or(0)
    }

    /// `key` now holds `held` entries: its count, and its place among each class's holders.
    fn set_held(&mut self, key: u64, held: usize) {
        let was = self.held(key);
        for c in &mut self.classes {
            if c.by_key.contains_key(&key) {
                c.holders.remove(&(was, key));
                c.holders.insert((held, key));
            }
        }
        if held == 0 {
            self.per_key.remove(&key);
        } else {
            self.per_key.insert(key, held);
        }
    }

    pub fn push(&mut self, key: u64, class: usize, tokens: u64, item: T) -> Pushed<T> {
        let class = class.min(self.classes.len() - 1);
        let (held, share) = (self.held(key), self.share(key));
        if held >= share {
            let why = if held < self.capacity && self.per_key.len() > 1 {
                Full::KeyShare
            } else {
                Full::Queue
            };
            return Pushed::Refused(why, item);
        }
        let evicted = if self.len >= self.capacity {
            match self.victim(class, share) {
                Some((c, k)) => self.take_newest(c, k),
                None => return Pushed::Refused(Full::Queue, item),
            }
        } else {
            None
        };
        let id = self.next_id;
        self.next_id += 1;
        let held = self.held(key);
        let c = &mut self.classes[class];
        if !c.by_key.contains_key(&key) {
            let at = c.next_turn;
            c.next_turn += 1;
            c.turn.insert(at, key);
            c.holders.insert((held, key));
            let q = KeyQueue {
                entries: BTreeMap::new(),
                turn_at: at,
            };
            c.by_key.insert(key, q);
        }
        let entry = Entry {
            id,
            key,
            class,
            tokens,
            item,
        };
        if let Some(q) = c.by_key.get_mut(&key) {
            q.entries.insert(id, entry);
        }
        c.len += 1;
        self.len += 1;
        self.set_held(key, held + 1);
        self.index.insert(id, (class, key));
        match evicted {
            Some(e) => Pushed::Evicted(id, e),
            None => Pushed::Queued(id),
        }
    }

    /// Whose newest entry makes room for a request of `class`: in the lowest class below it
    /// that has any, the largest holder; in its own class, the largest holder if over `share`.
    fn victim(&self, class: usize, share: usize) -> Option<(usize, u64)> {
        for c in (class..self.classes.len()).rev() {
            if let Some(&(held, k)) = self.classes[c].holders.last() {
                if c > class || held > share {
                    return Some((c, k));
                }
            }
        }
        None
    }

    fn take_newest(&mut self, class: usize, key: u64) -> Option<Entry<T>> {
        let q = self.classes[class].by_key.get_mut(&key)?;
        let (_, e) = q.entries.pop_last()?;
        self.forget(&e);
        Some(e)
    }

    /// Bookkeeping after `e` left its key's queue.
    fn forget(&mut self, e: &Entry<T>) {
        self.len -= 1;
        self.index.remove(&e.id);
        let held = self.held(e.key);
        let c = &mut self.classes[e.class];
        c.len -= 1;
        if c.by_key.get(&e.key).is_some_and(|q| q.entries.is_empty()) {
            if let Some(q) = c.by_key.remove(&e.key) {
                c.turn.remove(&q.turn_at);
            }
            c.holders.remove(&(held, e.key));
        }
        self.set_held(e.key, held.saturating_sub(1));
    }

    /// The entry [`Self::pop`] would give.
    pub fn peek(&self) -> Option<&Entry<T>> {
        let c = self.classes.iter().find(|c| !c.turn.is_empty())?;
        let (_, key) = c.turn.first_key_value()?;
        c.by_key.get(key)?.entries.first_key_value().map(|(_, e)| e)
    }

    /// The next entry: the highest class's key whose turn it is, its oldest request.
    pub fn pop(&mut self) -> Option<Entry<T>> {
        let class = self.classes.iter().position(|c| !c.turn.is_empty())?;
        let key = *self.classes[class].turn.first_key_value()?.1;
        self.take(class, key, None)
    }

    /// Takes `key`'s entry `id` (its oldest when `None`) from `class`; the key goes to the
    /// back of its turn.
    fn take(&mut self, class: usize, key: u64, id: Option<u64>) -> Option<Entry<T>> {
        let c = &mut self.classes[class];
        let q = c.by_key.get_mut(&key)?;
        let e = match id {
            Some(id) => q.entries.remove(&id)?,
            None => q.entries.pop_first()?.1,
        };
        c.move_to_back(key);
        self.forget(&e);
        Some(e)
    }

    /// The first entry, in [`Self::pop`]'s order, that `fits`: the highest class first, keys in
    /// turn, each key's oldest that fits (a request for a model whose replicas have room is
    /// not held behind the same key's requests for a saturated one); the key then goes to the
    /// back of its turn.
    pub fn pop_where(&mut self, mut fits: impl FnMut(&Entry<T>) -> bool) -> Option<Entry<T>> {
        for class in 0..self.classes.len() {
            let c = &self.classes[class];
            let found = c.turn.values().find_map(|k| {
                let q = c.by_key.get(k)?;
                let e = q.entries.values().find(|e| fits(e))?;
                Some((*k, e.id))
            });
            if let Some((key, id)) = found {
                return self.take(class, key, Some(id));
            }
        }
        None
    }

    /// Takes out the entry `id` (its client left, or it waited too long); `None` when it is
    /// no longer queued.
    pub fn remove(&mut self, id: u64) -> Option<Entry<T>> {
        let (class, key) = *self.index.get(&id)?;
        let e = self.classes[class]
            .by_key
            .get_mut(&key)?
            .entries
            .remove(&id)?;
        self.forget(&e);
        Some(e)
    }

    /// The memory the queue holds now, in bytes (its tables' allocations, not the items'
    /// own heap data). An ordered map's node holds up to 11 entries, about two thirds full.
    pub fn approx_bytes(&self) -> usize {
        use std::mem::size_of;
        let tree = |n: usize, each: usize| n * each * 3 / 2;
        let classes: usize = self
            .classes
            .iter()
            .map(|c| {
                tree(c.len, size_of::<(u64, Entry<T>)>())
                    + c.by_key.capacity() * (size_of::<(u64, KeyQueue<T>)>() + 1)
                    + tree(c.turn.len(), 16)
                    + tree(c.holders.len(), 16)
            })
            .sum();
        classes
            + self.per_key.capacity() * (size_of::<(u64, usize)>() + 1)
            + self.index.capacity() * (size_of::<(u64, (usize, u64))>() + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(q: &mut Queue<u32>) -> Vec<u32> {
        std::iter::from_fn(|| q.pop().map(|e| e.item)).collect()
    }

    #[test]
    fn higher_classes_first_keys_in_turn_within_a_class() {
        let mut q = Queue::new(100, 2);
        // key 1 floods batch (class 1) and standard...
        for i in 0..4 {
            q.push(1, 1, 10, 10 + i);
        }
        q.push(2, 1, 10, 20);
        q.push(3, 0, 10, 30);
        q.push(2, 1, 10, 21);
        q.push(3, 0, 10, 31);
        assert_eq!(q.peek().map(|e| e.item), Some(30));
        assert_eq!(q.len_by_class(), vec![2, 6]);
        assert_eq!(ids(&mut q), vec![30, 31, 10, 20, 11, 21, 12, 13]);
        assert!(q.is_empty() && q.per_key.is_empty() && q.index.is_empty());
    }

    #[test]
    fn pop_where_skips_what_does_not_fit_in_the_queues_order() {
        let mut q = Queue::new(100, 2);
        q.push(1, 0, 10, 10); // class 0, key 1: does not fit
        q.push(1, 0, 10, 11);
        q.push(2, 0, 10, 20);
        q.push(3, 1, 10, 30);
        q.push(2, 0, 10, 21);
        let fits = |e: &Entry<u32>| e.item != 10;
        // Key 1's oldest does not fit: its next one goes, then key 2 in turn, then class 1.
        assert_eq!(q.pop_where(fits).map(|e| e.item), Some(11));
        assert_eq!(q.pop_where(fits).map(|e| e.item), Some(20));
        assert_eq!(q.pop_where(fits).map(|e| e.item), Some(21));
        assert_eq!(q.pop_where(fits).map(|e| e.item), Some(30));
        assert_eq!(q.pop_where(fits).map(|e| e.item), None);
        assert_eq!(q.len(), 1);
        assert_eq!(q.pop_where(|_| true).map(|e| e.item), Some(10));
        assert!(q.is_empty());
        assert!(q.per_key.is_empty() && q.index.is_empty());
    }

    #[test]
    fn no_key_holds_more_than_its_share() {
        let mut q = Queue::new(4, 1);
        for i in 0..4 {
            assert!(matches!(q.push(1, 0, 1, i), Pushed::Queued(_)));
        }
        // Alone it may fill the queue; then the queue is full.
        assert!(matches!(
            q.push(1, 0, 1, 9),
            Pushed::Refused(Full::Queue, 9)
        ));
        // A second key's share is half: the flooder's newest goes.
        match q.push(2, 0, 1, 20) {
            Pushed::Evicted(_, e) => assert_eq!((e.key, e.item), (1, 3)),
            other => panic!("{other:?}"),
        }
        match q.push(2, 0, 1, 21) {
            Pushed::Evicted(_, e) => assert_eq!((e.key, e.item), (1, 2)),
            other => panic!("{other:?}"),
        }
        // Both at their share of 2 now.
        assert!(matches!(
            q.push(2, 0, 1, 22),
            Pushed::Refused(Full::KeyShare, 22)
        ));
        assert!(matches!(
            q.push(1, 0, 1, 12),
            Pushed::Refused(Full::KeyShare, 12)
        ));
        assert_eq!(ids(&mut q), vec![0, 20, 1, 21]);
    }

    #[test]
    fn a_full_queue_makes_room_for_a_higher_class_only() {
        let mut q = Queue::new(2, 2);
        q.push(1, 1, 1, 10);
        q.push(2, 1, 1, 20);
        // Same class, every key within its share of a three-key queue (1 each): full.
        assert!(matches!(
            q.push(3, 1, 1, 30),
            Pushed::Refused(Full::Queue, _)
        ));
        match q.push(3, 0, 1, 31) {
            Pushed::Evicted(_, e) => assert_eq!(e.class, 1),
            other => panic!("{other:?}"),
        }
        assert_eq!(q.peek().map(|e| e.item), Some(31));
    }

    #[test]
    fn a_removed_entry_leaves_at_once_and_its_id_is_gone() {
        let mut q = Queue::new(10, 1);
        let Pushed::Queued(a) = q.push(1, 0, 1, 1) else {
            panic!()
        };
        let Pushed::Queued(b) = q.push(1, 0, 1, 2) else {
            panic!()
        };
        assert_eq!(q.remove(a).map(|e| e.item), Some(1));
        assert!(q.remove(a).is_none());
        assert_eq!(q.len(), 1);
        assert_eq!(q.pop().map(|e| e.id), Some(b));
        assert!(q.remove(b).is_none(), "popped already");
        assert!(q.approx_bytes() > 0);
    }

    #[test]
    fn five_thousand_entries_take_about_a_megabyte() {
        // What the balancer queues: a one-shot sender per waiter (its shared cell is a small
        // allocation of its own, counted separately below).
        let mut q: Queue<tokio::sync::oneshot::Sender<u8>> = Queue::new(5000, 2);
        let cells = 5000 * 96;
        for i in 0..5000u64 {
            let (tx, _rx) = tokio::sync::oneshot::channel();
            assert!(matches!(
                q.push(i % 2, (i % 2) as usize, 300, tx),
                Pushed::Queued(_)
            ));
        }
        let bytes = q.approx_bytes() + cells;
        eprintln!("5000 queued: {bytes} bytes, {} a request", bytes / 5000);
        assert!(bytes < 3 << 19, "{bytes}");
    }

    #[test]
    fn the_bound_holds_under_many_keys_and_many_pushes() {
        let mut q = Queue::new(1000, 3);
        let mut queued = 0;
        for i in 0..20_000u32 {
            let key = u64::from(i % 7);
            match q.push(key, (i % 3) as usize, 100, i) {
                Pushed::Queued(_) => queued += 1,
                Pushed::Evicted(..) | Pushed::Refused(..) => {}
            }
            assert!(q.len() <= 1000);
            assert!(q.held(key) <= q.share(key).max(1000 / 7 + 1));
        }
        assert_eq!(q.len(), 1000);
        assert!(queued >= 1000);
        let n = ids(&mut q).len();
        assert_eq!(n, 1000);
    }
}

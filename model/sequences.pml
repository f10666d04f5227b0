/*
 * The shardrun sequence protocol, for spin: where the tasks of sequences
 * are (store/moves.go, store/sql/shardrun_settle.sql and the moves that
 * end with it), with PostgreSQL's row locks and snapshots.
 *
 * Two sequences, "a" and "b" (keys sort a < b), and five tasks, numbered
 * in id order:
 *   t0 (b), t1 (a)   enqueued before the model starts: each heads its
 *                    sequence, in its lane
 *   t2 (a), t3 (b)   a producer's batch, one transaction
 *   t4 (a)           a single enqueue, its own transaction
 * The tasks of "a" block their sequence when they end dead or failed
 * (sequence_blocks), those of "b" do not. With UNIQUE, t1 and t4 have the
 * same unique key, U: t4's insert finds it held while t1 is unfinished.
 * The actors: the two producers, one runner holding up to two claims, one
 * operator (cancel, retry) and retention. model/README.md maps every step
 * to the SQL.
 *
 * The shared state is the committed state. A transaction takes its row
 * locks one step each (each may wait for the holder's commit), then reads
 * and writes in one atomic step that ends with its commit and releases
 * them: what it reads there is what a statement reads with a snapshot
 * taken after the locks. A transaction that reads before its locks keeps
 * what it read in local variables, and acts on them after (a snapshot
 * read: the difference is the bug class this model is for).
 *
 * Parameters (spin -D...):
 *   FAILS      attempts that fail and go back to their lane (attempts left)
 *   FINALS     attempts that fail for good (dead)
 *   OPS        operator actions (a cancel or a retry of any task)
 *   RETENTION  1: retention deletes dead tasks
 *   MAXCLAIMS  claims the runner holds at once (2: a batch of outcomes)
 *   UNIQUE     1: t1 and t4 have the unique key U
 *   NO_LAYOUT_CHECK  check OneRunnable and Headed in every state, not Layout
 * The protocol before its fixes (issue 32, c7a8b42), each a counterexample:
 *   CANCEL_LOOK_FIRST  the cancel sees where the task is (its lane, the
 *            head) in a snapshot taken before its locks, and acts on that
 *   RETENTION_DELETES_HEADS  retention does not keep a blocked head
 *   SETTLE_BY_ID  a batch of outcomes locks the sequences in the order of
 *            its tasks' ids, not of their keys
 *   PROMOTE_BY_ID the next head is the waiting task with the lowest id
 *            (the order of the inserts), not the first to join (of the
 *            commits)
 *   RETRY_SEQUENCE_FIRST  the retry locks the task's sequence before it
 *            takes the task's unique key (shardrun_lock_tasks; before
 *            commit c7a8b42)
 */

#ifndef FAILS
#define FAILS 1
#endif
#ifndef FINALS
#define FINALS 1
#endif
#ifndef OPS
#define OPS 2
#endif
#ifndef RETENTION
#define RETENTION 1
#endif
#ifndef MAXCLAIMS
#define MAXCLAIMS 2
#endif
#ifndef CANCEL_LOOK_FIRST
#define CANCEL_LOOK_FIRST 0
#endif
#ifndef RETENTION_DELETES_HEADS
#define RETENTION_DELETES_HEADS 0
#endif
#ifndef SETTLE_BY_ID
#define SETTLE_BY_ID 0
#endif
#ifndef PROMOTE_BY_ID
#define PROMOTE_BY_ID 0
#endif
#ifndef UNIQUE
#define UNIQUE 1
#endif
#ifndef RETRY_SEQUENCE_FIRST
#define RETRY_SEQUENCE_FIRST 0
#endif

#define NT 5            /* tasks */
#define NK 2            /* sequences */
#define KA 0            /* sequence "a" */
#define KB 1            /* sequence "b" */
#define KEY(t)    (((t) == 0 || (t) == 3) -> KB : KA)
#define BLOCKS(t) (KEY(t) == KA)        /* tasks.sequence_blocks */
#define BIT(t)    (1 << (t))
#define HASKEY(t) (UNIQUE && ((t) == 1 || (t) == 4))   /* tasks.unique_key = U */
#define NONE 255

/* A task's record: tasks.state. */
#define NEW       0     /* not committed: not inserted yet, or its producer's transaction is open */
#define READY     1     /* unfinished */
#define COMPLETED 2
#define CANCELLED 3
#define DEAD      4     /* dead or failed */
#define GONE      5     /* deleted by retention */

/* Its place: the one table that has it. */
#define P_NONE  0       /* none (finished, or not committed) */
#define P_LANE  1       /* task_ready: claimable */
#define P_WAIT  2       /* task_waiting: waiting its turn, at pos */
#define P_CLAIM 3       /* task_claims: running */

/* The runner's outcomes (store/moves.go). */
#define COMPLETE   1    /* Complete */
#define FAIL_AGAIN 2    /* Fail with attempts left (or Interrupt, Unclaim): ready again */
#define FAIL_FINAL 3    /* Fail with none left, or Final: dead */
#define CANCEL_ATT 4    /* CancelAttempts: the handler stopped on the cancel request */

/* The actors, as owners of row locks. */
#define FREE      0
#define BATCH     1
#define SINGLE    2
#define RUNNER    3
#define OPERATOR  4
#define RETAINER  5
#define NACT      6

/* ---- PostgreSQL: committed rows ---- */
byte st[NT];            /* tasks.state */
byte place[NT];         /* its task_ready, task_waiting or task_claims entry */
byte pos[NT];           /* task_waiting.pos (compared within a sequence only) */
bool creq[NT];          /* tasks.cancel_requested_at IS NOT NULL */
byte head[NK] = NONE;   /* task_sequences.head_id; NONE: the sequence has no row */
bool blocked[NK];       /* task_sequences.blocked_at IS NOT NULL */
byte nextpos[NK];       /* the identity behind pos */
byte kholder = NONE;    /* task_unique_keys row of U: the task holding it (an
                         * unfinished one no cancel was requested for), NONE if none */

/* ---- PostgreSQL: row locks, held to the commit ---- */
#define SEQ(k) (k)              /* task_sequences row of key k (or the key, while it has no row) */
#define REC(t) (NK + (t))       /* tasks row t */
#define UK (NK + NT)            /* the unique key U: its row, or the index entry of
                                 * an uncommitted insert of it */
#define NL (NK + NT + 1)
byte lk[NL];            /* each lock's holder, FREE if none */
byte waits[NACT];       /* the lock (index + 1) each actor waits for, 0 if none */

/* ---- the specification's own bookkeeping ---- */
byte ord[NT];           /* when the task joined its sequence: its producer's
                         * commit; a retried task joins again, at the end,
                         * unless it is the blocked head (it keeps its turn) */
byte joined[NK];        /* joins so far, per sequence */
bool done[NT];          /* completed (for Progress) */
bool duplicate;         /* t4 was not inserted: U was held */

/* ---- the actors' budgets ---- */
byte fails, finals, nclaims;

/* Scratch, used inside atomic steps only and 0 between them (a
 * breadth-first search allows no hidden variables). */
byte x, h, best, ca, cn;

/* The properties, named for spin's messages; true between steps. */
bool OneRunnable = true, InOrder = true, Headed = true, Layout = true, NoDeadlock = true;

/* --------------------------------------------------------------- narration
 * printf is not run by the search; it narrates counterexamples (spin -t). */

inline who(me) {
	if
	:: me == BATCH -> printf("batch producer's commit")
	:: me == SINGLE -> printf("single producer")
	:: me == RUNNER -> printf("runner")
	:: me == OPERATOR -> printf("operator")
	:: else -> printf("retention")
	fi
}

inline row(l) {
	if
	:: l < NK -> printf("sequence %c", 'a' + l)
	:: l == UK -> printf("unique key U")
	:: else -> printf("record t%d", l - NK)
	fi
}

/* The committed layout, one line. */
inline print_layout() {
	printf("      ");
	x = 0;
	do
	:: x < NT ->
		printf("t%d(%c) ", x, 'a' + KEY(x));
		if
		:: st[x] == NEW -> printf("not committed")
		:: st[x] == READY -> printf("ready")
		:: st[x] == COMPLETED -> printf("completed")
		:: st[x] == CANCELLED -> printf("cancelled")
		:: st[x] == DEAD -> printf("dead")
		:: else -> printf("deleted")
		fi;
		if
		:: place[x] == P_LANE -> printf(" in its lane")
		:: place[x] == P_WAIT -> printf(" waiting (pos %d)", pos[x])
		:: place[x] == P_CLAIM -> printf(" claimed")
		:: else
		fi;
		if :: creq[x] -> printf(" (cancel requested)") :: else fi;
		printf("; ");
		x++
	:: else -> break
	od;
	x = 0;
	do
	:: x < NK ->
		printf("%c: ", 'a' + x);
		if
		:: head[x] == NONE -> printf("no row")
		:: else -> printf("head t%d", head[x])
		fi;
		if :: blocked[x] -> printf(" blocked") :: else fi;
		if :: x == 0 -> printf(", ") :: else fi;
		x++
	:: else -> break
	od;
	if
	:: UNIQUE && kholder != NONE -> printf("; U: t%d", kholder)
	:: UNIQUE && kholder == NONE -> printf("; U: free")
	:: else
	fi;
	printf("\n");
	x = 0
}

/* ------------------------------------------------------------------ locks */

/* NoDeadlock: actor me is about to wait: following, from me, who holds
 * what each waiter waits for must not lead back to me. (PostgreSQL would
 * find the cycle and abort a transaction: 40P01, an error to its caller.) */
inline no_cycle(me) {
	ca = me; cn = 0;
	do
	:: cn < NACT && waits[ca] != 0 && lk[waits[ca] - 1] != FREE ->
		ca = lk[waits[ca] - 1]; cn++;
		if :: ca == me -> NoDeadlock = false; break :: else fi
	:: else -> break
	od;
	assert(NoDeadlock);
	ca = 0; cn = 0
}

/* A row lock (FOR UPDATE, or the INSERT ... ON CONFLICT DO UPDATE of
 * shardrun_lock_sequences): take it, or wait for its holder's commit. */
inline lock(l, me) {
	if
	:: d_step { lk[l] == FREE || lk[l] == me -> lk[l] = me;
		who(me); printf(": locks "); row(l); printf("\n") }
	:: d_step { lk[l] != FREE && lk[l] != me ->
		who(me); printf(": waits for "); row(l); printf(", held by "); who(lk[l]); printf("\n");
		waits[me] = l + 1;
		no_cycle(me) }
		d_step { lk[l] == FREE -> lk[l] = me; waits[me] = 0;
			who(me); printf(": locks "); row(l); printf("\n") }
	fi
}

/* The commit: the transaction's locks go. */
inline unlock_all(me) {
	x = 0;
	do
	:: x < NL -> if :: lk[x] == me -> lk[x] = FREE :: else fi; x++
	:: else -> break
	od;
	x = 0
}

/* shardrun_lock_sequences of two keys: in key order. */
inline lock_keys(k1, k2, me) {
	if
	:: k1 <= k2 -> lock(SEQ(k1), me); lock(SEQ(k2), me)
	:: else -> lock(SEQ(k2), me); lock(SEQ(k1), me)
	fi
}

/* ----------------------------------------------------------------- settle */

/* shardrun_settle of sequence k (its lock held) for the tasks of mask. */
inline settle(k, mask) {
	/* 2. a head that finished releases the sequence (completed,
	 *    cancelled, dead that does not block, deleted); dead that blocks
	 *    blocks it; a ready one unblocks it */
	if
	:: head[k] != NONE ->
		h = head[k];
		if
		:: st[h] == READY -> blocked[k] = false
		:: st[h] == DEAD && BLOCKS(h) -> blocked[k] = true
		:: else -> head[k] = NONE; blocked[k] = false
		fi
	:: else
	fi;
	/* 3. the tasks of mask that are ready and in no place (new, retried)
	 *    wait, after those already waiting, in id order */
	x = 0;
	do
	:: x < NT ->
		if
		:: ((mask) & BIT(x)) && KEY(x) == k && st[x] == READY && head[k] != x && place[x] == P_NONE ->
			nextpos[k]++; pos[x] = nextpos[k]; place[x] = P_WAIT
		:: else
		fi;
		x++
	:: else -> break
	od;
	/* 4. a sequence without a head: its first waiting task heads it; with
	 *    none, the sequence ends (its row goes) */
	if
	:: head[k] == NONE ->
		best = NONE; x = 0;
		do
		:: x < NT ->
			if
#if PROMOTE_BY_ID
			:: place[x] == P_WAIT && KEY(x) == k && best == NONE -> best = x
#else
			:: place[x] == P_WAIT && KEY(x) == k && (best == NONE || pos[x] < pos[best]) -> best = x
#endif
			:: else
			fi;
			x++
		:: else -> break
		od;
		if
		:: best != NONE -> head[k] = best; place[best] = P_NONE; pos[best] = 0; blocked[k] = false
		:: else
		fi
	:: else
	fi;
	/* (pos only orders: with nobody waiting, it counts from 0 again) */
	x = 0;
	do
	:: x < NT && !(place[x] == P_WAIT && KEY(x) == k) -> x++
	:: x < NT && place[x] == P_WAIT && KEY(x) == k -> break
	:: x == NT -> nextpos[k] = 0; break
	od;
	/* 5. a head that is ready and in no place goes into its lane */
	if
	:: head[k] != NONE && st[head[k]] == READY && place[head[k]] == P_NONE -> place[head[k]] = P_LANE
	:: else
	fi;
	x = 0; h = 0; best = 0
}

/* ------------------------------------------------------------- invariants */

/* OneRunnable: at most one task of sequence k claimable (a lane entry of an
 * unfinished task) or running (a claim). */
#define RC(t, k) ((KEY(t) == k && (place[t] == P_CLAIM || (place[t] == P_LANE && st[t] == READY))) -> 1 : 0)
#define RUNNABLE(k) (RC(0, k) + RC(1, k) + RC(2, k) + RC(3, k) + RC(4, k))
#define ONE_RUNNABLE (RUNNABLE(KA) <= 1 && RUNNABLE(KB) <= 1)

/* Headed: a sequence with an unfinished task has a head, unfinished, or
 * dead or failed and marked blocked. */
#define UNF(t, k) (KEY(t) == k && st[t] == READY)
#define HAS_UNFINISHED(k) (UNF(0, k) || UNF(1, k) || UNF(2, k) || UNF(3, k) || UNF(4, k))
#define GOOD_HEAD(k) (head[k] != NONE && KEY(head[k]) == k && \
	(st[head[k]] == READY || (st[head[k]] == DEAD && BLOCKS(head[k]) && blocked[k])))
#define HEADED ((!HAS_UNFINISHED(KA) || GOOD_HEAD(KA)) && (!HAS_UNFINISHED(KB) || GOOD_HEAD(KB)))

/* Layout (shardrun_layout_violations, for sequences): an unfinished task
 * is in one place, a finished one in none; it is claimable or running only
 * as its sequence's head, waiting only if not; a task whose cancel was
 * requested is not claimable; a sequence's row has a good head, and only a
 * dead head blocks it; the unique key is held by its unfinished task, one
 * no cancel was requested for, and every such task holds it. */
#define PLACED(t) ((st[t] == READY) == (place[t] != P_NONE) && \
	(place[t] != P_WAIT || head[KEY(t)] != t) && \
	(!(place[t] == P_LANE || place[t] == P_CLAIM) || head[KEY(t)] == t) && \
	!(creq[t] && st[t] == READY && place[t] != P_CLAIM))
#define ROW(k) ((head[k] == NONE && !blocked[k]) || (GOOD_HEAD(k) && (!blocked[k] || st[head[k]] == DEAD)))
#define HOLDS(t) (!(HASKEY(t) && st[t] == READY && !creq[t]) || kholder == t)
#define KEYS ((kholder == NONE || (st[kholder] == READY && !creq[kholder])) && HOLDS(1) && HOLDS(4))
#define LAYOUT (PLACED(0) && PLACED(1) && PLACED(2) && PLACED(3) && PLACED(4) && ROW(KA) && ROW(KB) && KEYS)
#ifdef NO_LAYOUT_CHECK
#define ALL_GOOD (ONE_RUNNABLE && HEADED)
#else
#define ALL_GOOD (ONE_RUNNABLE && HEADED && LAYOUT)
#endif

/* Checked in every state, that is after every commit: the monitor waits
 * for one of them to be false. */
proctype monitor() {
end:	atomic { !ALL_GOOD ->
		OneRunnable = ONE_RUNNABLE; assert(OneRunnable);
		Headed = HEADED; assert(Headed);
		Layout = LAYOUT; assert(Layout) }
}

/* InOrder, checked where it can become false: a task starts (is claimed)
 * only if no waiting task of its sequence joined before it. */
inline check_order(t) {
	x = 0;
	do
	:: x < NT ->
		InOrder = !(x != t && KEY(x) == KEY(t) && place[x] == P_WAIT && ord[x] < ord[t]);
		assert(InOrder);
		x++
	:: else -> break
	od;
	x = 0
}

/* -------------------------------------------------------------- producers */

/* A producer's transaction commits the tasks of mask; the tasks join their
 * sequences in the order of the commits. */
inline commit_tasks(mask) {
	x = 0;
	do
	:: x < NT ->
		if
		:: (mask) & BIT(x) -> st[x] = READY; joined[KEY(x)]++; ord[x] = joined[KEY(x)]
		:: else
		fi;
		x++
	:: else -> break
	od;
	x = 0
}

/* The batch: t2 (a) and t3 (b), one transaction. Its INSERT locks nothing
 * another transaction waits for (its new rows and unique keys, invisible
 * to others) and changes nothing another sees, so it is no step here; the
 * transaction may stay open any number of steps. At its commit the deferred
 * trigger (shardrun_settle_at_commit) locks the sequences, in key order,
 * and settles them. */
proctype batch() {
	lock(SEQ(KA), BATCH);
	lock(SEQ(KB), BATCH);
	d_step {
		commit_tasks(BIT(2) | BIT(3)); settle(KA, BIT(2)); settle(KB, BIT(3)); unlock_all(BATCH);
		printf("batch producer: commits t2 (a) and t3 (b), settled\n"); print_layout() }
}

/* The single enqueue: t4 (a), in its own transaction or the caller's.
 * With UNIQUE its INSERT (enqueue_unique) takes the unique key U first:
 * it waits for a transaction that inserts or deletes U, and inserts
 * nothing if an unfinished task holds U (the producer is answered with
 * that task). The new key is held to the commit. */
proctype single() {
#if UNIQUE
	lock(UK, SINGLE);
	if
	:: d_step { kholder != NONE ->
		printf("single producer: U is held by t%d: t4 is not inserted\n", kholder);
		duplicate = true; unlock_all(SINGLE) }
	:: d_step { kholder == NONE -> printf("single producer: inserts t4, taking U\n") }
		lock(SEQ(KA), SINGLE);
		d_step {
			commit_tasks(BIT(4)); kholder = 4; settle(KA, BIT(4)); unlock_all(SINGLE);
			printf("single producer: commits t4 (a), settled\n"); print_layout() }
	fi
#else
	lock(SEQ(KA), SINGLE);
	d_step {
		commit_tasks(BIT(4)); settle(KA, BIT(4)); unlock_all(SINGLE);
		printf("single producer: commits t4 (a), settled\n"); print_layout() }
#endif
}

/* ----------------------------------------------------------------- runner */

/* The runner's write about its claim of t (endClaims): the claim row goes;
 * the record, if still unfinished, takes the outcome (a requested cancel
 * turns a failure into cancelled). */
inline end_claim(t, how) {
	place[t] = P_NONE; nclaims--;
	if
	:: st[t] == READY ->
		if
		:: how == COMPLETE -> st[t] = COMPLETED; done[t] = true
		:: how == FAIL_AGAIN && !creq[t] -> skip
		:: how == FAIL_FINAL && !creq[t] -> st[t] = DEAD
		:: else -> st[t] = CANCELLED
		fi;
		if :: st[t] != READY -> creq[t] = false :: else fi;
		if :: st[t] != READY && kholder == t -> kholder = NONE :: else fi
	:: else                                 /* not ready (weakened runs only): no update */
	fi
}

inline say_outcome(t, how) {
	printf("runner: ");
	if
	:: how == COMPLETE -> printf("completes")
	:: how == FAIL_AGAIN -> printf("fails, attempts left,")
	:: how == FAIL_FINAL -> printf("fails for good")
	:: else -> printf("stops on the cancel request of")
	fi;
	printf(" t%d\n", t)
}

#define LANE(t)  (place[t] == P_LANE)
#define CLAIM(t) (place[t] == P_CLAIM)
#define ANY(M)   (M(0) || M(1) || M(2) || M(3) || M(4))

proctype runner() {
	byte t, u, how;
end:
	do
	/* Claim: the lane entry deleted, a claim row inserted, one statement
	 * (no record or sequence lock) */
	:: atomic { nclaims < MAXCLAIMS && ANY(LANE) ->
		if
		:: LANE(0) -> t = 0
		:: LANE(1) -> t = 1
		:: LANE(2) -> t = 2
		:: LANE(3) -> t = 3
		:: LANE(4) -> t = 4
		fi;
		d_step {
			if
			:: st[t] == READY -> printf("runner: claims t%d\n", t);
				check_order(t); place[t] = P_CLAIM; nclaims++
			:: else -> place[t] = P_NONE;       /* a finished task's entry: nothing to run */
				printf("runner: deletes the lane entry of finished t%d\n", t)
			fi;
			print_layout();
			t = 0 } }

	/* One claim's outcome, one transaction: the claim row (its own), the
	 * record, the sequence; then settle and commit */
	:: atomic { nclaims > 0 ->
		if
		:: CLAIM(0) -> t = 0
		:: CLAIM(1) -> t = 1
		:: CLAIM(2) -> t = 2
		:: CLAIM(3) -> t = 3
		:: CLAIM(4) -> t = 4
		fi;
		if
		:: how = COMPLETE
		:: fails < FAILS -> fails++; how = FAIL_AGAIN
		:: finals < FINALS -> finals++; how = FAIL_FINAL
		:: creq[t] -> how = CANCEL_ATT
		fi;
		d_step { say_outcome(t, how) } }
		lock(REC(t), RUNNER);
		if
		:: st[t] == READY -> lock(SEQ(KEY(t)), RUNNER);
			if                                  /* a finished task's unique key goes, last */
			:: HASKEY(t) && kholder == t && how != FAIL_AGAIN -> lock(UK, RUNNER)
			:: else
			fi
		:: else                                 /* no update, nothing to settle */
		fi;
		d_step {
			if
			:: st[t] == READY -> end_claim(t, how); settle(KEY(t), BIT(t))
			:: else -> end_claim(t, how)
			fi;
			unlock_all(RUNNER);
			printf("runner: commits the outcome of t%d\n", t); print_layout();
			t = 0; how = 0 }

	/* Two claims completed in one statement (a batch of outcomes): the
	 * claims, the records in id order (t < u), the sequences */
	:: atomic { nclaims == 2 ->
		if
		:: CLAIM(0) && CLAIM(1) -> t = 0; u = 1
		:: CLAIM(0) && CLAIM(2) -> t = 0; u = 2
		:: CLAIM(0) && CLAIM(3) -> t = 0; u = 3
		:: CLAIM(0) && CLAIM(4) -> t = 0; u = 4
		:: CLAIM(1) && CLAIM(2) -> t = 1; u = 2
		:: CLAIM(1) && CLAIM(3) -> t = 1; u = 3
		:: CLAIM(1) && CLAIM(4) -> t = 1; u = 4
		:: CLAIM(2) && CLAIM(3) -> t = 2; u = 3
		:: CLAIM(2) && CLAIM(4) -> t = 2; u = 4
		:: CLAIM(3) && CLAIM(4) -> t = 3; u = 4
		fi;
		d_step { how = COMPLETE; printf("runner: completes t%d and t%d in one statement\n", t, u) } }
		lock(REC(t), RUNNER);
		lock(REC(u), RUNNER);
#if SETTLE_BY_ID
		/* before the fix: each task's sequence, in the order of the ids */
		lock(SEQ(KEY(t)), RUNNER);
		lock(SEQ(KEY(u)), RUNNER);
#else
		lock_keys(KEY(t), KEY(u), RUNNER);
#endif
		if
		:: (HASKEY(t) && kholder == t) || (HASKEY(u) && kholder == u) -> lock(UK, RUNNER)
		:: else
		fi;
		d_step {
			end_claim(t, how); end_claim(u, how);
			settle(KEY(t), BIT(t) | BIT(u));
			if :: KEY(u) != KEY(t) -> settle(KEY(u), BIT(t) | BIT(u)) :: else fi;
			unlock_all(RUNNER);
			printf("runner: commits the outcomes of t%d and t%d\n", t, u); print_layout();
			t = 0; u = 0; how = 0 }
	od
}

/* --------------------------------------------------------------- operator */

#define CANCELABLE(t) (st[t] == READY || st[t] == DEAD)
#define RETRIABLE(t)  (st[t] == DEAD || st[t] == CANCELLED)

proctype operator() {
	byte t, ops;
	bool s_head, s_lane;    /* CANCEL_LOOK_FIRST: what the cancel saw before its locks */
end:
	do
	/* shardrun_cancel(t): the record, its sequence (shardrun_lock_tasks),
	 * then it looks where t is */
	:: atomic { ops < OPS && ANY(CANCELABLE) -> ops++;
		if
		:: CANCELABLE(0) -> t = 0
		:: CANCELABLE(1) -> t = 1
		:: CANCELABLE(2) -> t = 2
		:: CANCELABLE(3) -> t = 3
		:: CANCELABLE(4) -> t = 4
		fi;
		d_step {
#if CANCEL_LOOK_FIRST
			s_head = (head[KEY(t)] == t); s_lane = (place[t] == P_LANE);
			printf("operator: cancels t%d; its snapshot: t%d is ", t, t);
			if
			:: s_lane -> printf("in its lane\n")
			:: !s_lane && s_head -> printf("its sequence's head, not in its lane\n")
			:: else -> printf("not its sequence's head\n")
			fi
#else
			printf("operator: cancels t%d\n", t)
#endif
		} }
		lock(REC(t), OPERATOR);
		lock(SEQ(KEY(t)), OPERATOR);
		if                                      /* the unique key goes, last */
		:: HASKEY(t) && kholder == t -> lock(UK, OPERATOR)
		:: else
		fi;
		d_step {
			if
#if CANCEL_LOOK_FIRST
			/* before the fix: the record's state is the locked row's (the
			 * statement re-reads it), where the task is is the snapshot's:
			 * a lane entry the snapshot saw, if still there, is taken out
			 * (a DELETE finds only rows its snapshot sees); a task that was
			 * not the head was "waiting", and is taken out of the waiting
			 * line if still there */
			:: st[t] == READY && ((s_lane && place[t] == P_LANE) || !s_head) ->
				if
				:: s_lane && place[t] == P_LANE -> place[t] = P_NONE
				:: place[t] == P_WAIT -> place[t] = P_NONE
				:: else
				fi;
				st[t] = CANCELLED
			:: st[t] == READY -> creq[t] = true
			:: st[t] == DEAD && s_head -> st[t] = CANCELLED
#else
			/* in its lane or waiting: taken out, cancelled */
			:: st[t] == READY && (place[t] == P_LANE || place[t] == P_WAIT) -> place[t] = P_NONE; st[t] = CANCELLED
			/* claimed: a request; the runner's own write ends it */
			:: st[t] == READY && place[t] == P_CLAIM -> creq[t] = true
			/* dead or failed, heading (blocking) its sequence: cancelled */
			:: st[t] == DEAD && head[KEY(t)] == t -> st[t] = CANCELLED
#endif
			:: else                             /* finished: refused */
			fi;
			if :: kholder == t && (st[t] != READY || creq[t]) -> kholder = NONE :: else fi;
			if :: st[t] != READY -> creq[t] = false :: else fi;
			settle(KEY(t), BIT(t));
			unlock_all(OPERATOR);
			printf("operator: commits the cancel of t%d\n", t); print_layout();
			t = 0; s_head = 0; s_lane = 0 }

	/* shardrun_retry(t): the record; a dead, failed or cancelled task takes
	 * its unique key again (a unique violation if an unfinished task holds
	 * it: the retry fails, nothing changes) and is ready again, filed, its
	 * sequence locked (a blocked head unblocks into its lane, another task
	 * waits at the end) */
	:: atomic { ops < OPS && ANY(RETRIABLE) -> ops++;
		if
		:: RETRIABLE(0) -> t = 0
		:: RETRIABLE(1) -> t = 1
		:: RETRIABLE(2) -> t = 2
		:: RETRIABLE(3) -> t = 3
		:: RETRIABLE(4) -> t = 4
		fi;
		d_step { printf("operator: retries t%d\n", t) } }
		lock(REC(t), OPERATOR);
#if RETRY_SEQUENCE_FIRST
		/* before c7a8b42: shardrun_lock_tasks, the record and the
		 * sequence, then the key */
		lock(SEQ(KEY(t)), OPERATOR);
#endif
		if
		:: HASKEY(t) && (st[t] == DEAD || st[t] == CANCELLED) -> lock(UK, OPERATOR)
		:: else
		fi;
		if
		:: d_step { HASKEY(t) && (st[t] == DEAD || st[t] == CANCELLED) && kholder != NONE ->
			printf("operator: the retry of t%d fails: U is held by t%d\n", t, kholder);
			unlock_all(OPERATOR); t = 0 }
		:: else ->
#if !RETRY_SEQUENCE_FIRST
			lock(SEQ(KEY(t)), OPERATOR);
#endif
			d_step {
				if
				:: st[t] == DEAD || st[t] == CANCELLED ->
					st[t] = READY; creq[t] = false;
					if :: HASKEY(t) -> kholder = t :: else fi;
					if
					:: head[KEY(t)] != t -> joined[KEY(t)]++; ord[t] = joined[KEY(t)]
					:: else
					fi
				:: else                         /* unfinished: refused */
				fi;
				settle(KEY(t), BIT(t));
				unlock_all(OPERATOR);
				printf("operator: commits the retry of t%d\n", t); print_layout();
				t = 0 }
		fi
	od
}

/* -------------------------------------------------------------- retention */

#if RETENTION_DELETES_HEADS
#define DOOMED(t) (st[t] == DEAD)
#else
#define DOOMED(t) (st[t] == DEAD && head[KEY(t)] != t)
#endif

/* DeleteFinished of dead tasks: reads, in its statement's snapshot, the
 * dead tasks that head no sequence; then locks each one's record (SKIP
 * LOCKED: one another transaction holds is left for the next round),
 * re-reads the locked record's state, and deletes it. The sequence row is
 * not locked: the head check is the snapshot's. */
proctype retention() {
	byte t, s_st;
end:
	do
	:: atomic { ANY(DOOMED) ->
		if
		:: DOOMED(0) -> t = 0
		:: DOOMED(1) -> t = 1
		:: DOOMED(2) -> t = 2
		:: DOOMED(3) -> t = 3
		:: DOOMED(4) -> t = 4
		fi;
		d_step { s_st = st[t]; printf("retention: reads t%d, dead\n", t) } }
		d_step {
			if
			:: lk[REC(t)] != FREE -> printf("retention: skips t%d, locked\n", t)
			:: else ->
				if
				:: st[t] == s_st -> st[t] = GONE; printf("retention: deletes t%d\n", t); print_layout()
				:: else -> printf("retention: t%d is no longer dead\n", t)
				fi
			fi;
			t = 0; s_st = 0 }
	od
}

init {
	atomic {
		/* t0 heads "b" and t1 heads "a", each in its lane */
		st[0] = READY; place[0] = P_LANE; head[KB] = 0; ord[0] = 1; joined[KB] = 1;
		st[1] = READY; place[1] = P_LANE; head[KA] = 1; ord[1] = 1; joined[KA] = 1;
		if :: UNIQUE -> kholder = 1 :: else fi;
		printf("start\n"); print_layout();
		run monitor(); run batch(); run single(); run runner();
		if :: OPS > 0 -> run operator() :: else fi;
		if :: RETENTION -> run retention() :: else fi
	}
}

/* Progress: with no failure for good and no operator, every task inserted
 * is completed (check with weak fairness). */
ltl Progress { <> (done[0] && done[1] && done[2] && done[3] && (done[4] || duplicate)) }

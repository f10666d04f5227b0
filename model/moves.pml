/*
 * Moving a shard between databases online (issue 40), for spin.
 *
 * One shard, N, moves from database A to database B. Each database has,
 * for N, its placement row (shardrun_placement: state, peer), its fence
 * rows (shard_fences, with the moving flag) and its task rows; etcd has the
 * shard map (N -> A or B) and the move's intent (moves[N], with its phase).
 * The actors:
 *   driver    the move driver, in the leader: intent, leave, copy, commit,
 *             switch, arrive, done (the steps of model/README.md); it may
 *             crash at any point (its open transactions abort) and a new
 *             one recovers from the placement rows, resuming or rolling back
 *   producer  inserts t1 (its insert trigger checks the placement), holds
 *             its transaction open any number of steps, commits; refused, it
 *             re-reads the map and retries
 *   runner    claims (one statement under the fence, FOR SHARE, moving =
 *             false), runs the handler, which may record its completion in
 *             its own transaction (CompleteTx: a mark on the claim row, the
 *             row locked until that transaction commits), and writes the
 *             outcome (SKIP LOCKED: a held row is Busy; no claim at a gone
 *             shard is Busy): retried until it applies
 *   watch     the runner's view of the map, which lags
 *   sweeper   requeues a claim its runner no longer works on (the stale
 *             sweep, or a new owner's raise): what makes a lost outcome or an
 *             abandoned attempt run again
 * t0 is in A's lane when the model starts; t1 is the producer's.
 *
 * The shared state is the committed state; a transaction's row locks are
 * lk[]; each step is one statement, or one short transaction, and ends
 * with its commit unless it says otherwise (the copy's transaction at A,
 * the producer's, the handler's stay open across steps).
 * model/README.md maps every step to the Go of issue 40.
 *
 * Parameters (spin -D...):
 *   CRASHES  crashes of the driver explored (each restarts it: recovery)
 *   TX       1: a handler may record its completion in its own transaction
 *   MAXATT   attempts a task may be claimed (bounds a weakened run's loops)
 * The protocol's own choices, as the design text has them, and their fixes:
 *   RESUME_AT_COPY 1: recovery resumes at step 3 whatever A's placement
 *            (the design's text); 0 (the fix): at step 2, which is
 *            idempotent, so a crash between the intent and the leave is
 *            resumed with the leave
 *   PRODUCER_RR 1: the producer's transaction is REPEATABLE READ: its
 *            snapshot may be older than its insert (EnqueueTx allows it)
 *   PLACEMENT_FOR_SHARE 1: the trigger reads the placement row FOR SHARE
 *            (under REPEATABLE READ: a row changed since the snapshot is a
 *            serialization failure, retried like a refusal)
 *   RAISE    1: a new owner takes the shard over during the move: it reads
 *            the map and raises the fence (RaiseFences: an upsert of the
 *            fence rows at the new epoch, and a requeue of the older
 *            epoch's claims, SKIP LOCKED) where the map says; the runner
 *            is the old owner, its claims and writes under epoch 1
 *   COPY_LOCKS_FENCE 1: the copy also locks N's fence rows at A (FOR
 *            UPDATE) before it reads, so a raise waits for the commit (and
 *            is then refused "moved" and made at B)
 *   ZOMBIE   1: the driver may pause (its process frozen, its open
 *            transaction alive, its leadership lost) after the intent; a new
 *            leader's driver recovers meanwhile; the old one may wake and
 *            go on, or its transaction be ended by the server
 *   LEADER_FENCE 1: every statement of a move step holds its database's
 *            coordinator fence (FOR SHARE, the leader's epoch); a new leader
 *            raises it in A, then B, before it reads the placement rows (the
 *            raise at A waits for the old driver's open copy transaction),
 *            and every etcd step compares the leader key too
 *   ETCD_CAS_ONLY 1 (LEADER_FENCE): the etcd steps compare the move's
 *            revision only, as the design's text has it
 * Weakened protocols, each a counterexample:
 *   NO_PRODUCER_LOCK  the trigger checks the placement without the shared
 *            advisory lock, so the leave does not wait for its transaction
 *   COPY_WITHOUT_CLAIM_LOCKS  the copy reads the claims without locking
 *            them (FOR UPDATE), so a write lands at A after the copy read
 *   SWITCH_BEFORE_COMMIT  step 5 (switch) before step 4 (commit)
 *   GONE_IS_FENCE_LOST  a write that finds no claim at a gone shard is
 *            taken as a lost fence: the runner abandons the attempt
 *   NO_MOVING_FENCE  the leave does not set the fence rows moving
 *   RECOVER_BY_PHASE  recovery decides by the move's phase in etcd (leaving
 *            = not committed), not by A's placement row
 * Checks off (to see what a failure leads to): NO_RUN_CHECK (NoDoubleRun),
 *   NO_CLAIM_CHECK
 *   (NoClaimAfterCopy), NO_PRODUCER_CHECK (ProducerNeverWritesAtAAfterLeave),
 *   NO_OUTCOME_CHECK (OneOutcome), NO_SETTLED_CHECK (EndsSettled).
 */

#ifndef CRASHES
#define CRASHES 2
#endif
#ifndef TX
#define TX 1
#endif
#ifndef MAXATT
#define MAXATT 3
#endif
#ifndef RESUME_AT_COPY
#define RESUME_AT_COPY 0
#endif
#ifndef PRODUCER_RR
#define PRODUCER_RR 0
#endif
#ifndef PLACEMENT_FOR_SHARE
#define PLACEMENT_FOR_SHARE 0
#endif
#ifndef ZOMBIE
#define ZOMBIE 0
#endif
#ifndef ETCD_CAS_ONLY
#define ETCD_CAS_ONLY 0
#endif
#ifndef RAISE
#define RAISE 0
#endif
#ifndef COPY_LOCKS_FENCE
#define COPY_LOCKS_FENCE 0
#endif
#ifndef LEADER_FENCE
#define LEADER_FENCE 0
#endif
#ifndef NO_PRODUCER_LOCK
#define NO_PRODUCER_LOCK 0
#endif
#ifndef COPY_WITHOUT_CLAIM_LOCKS
#define COPY_WITHOUT_CLAIM_LOCKS 0
#endif
#ifndef SWITCH_BEFORE_COMMIT
#define SWITCH_BEFORE_COMMIT 0
#endif
#ifndef GONE_IS_FENCE_LOST
#define GONE_IS_FENCE_LOST 0
#endif
#ifndef NO_MOVING_FENCE
#define NO_MOVING_FENCE 0
#endif
#ifndef RECOVER_BY_PHASE
#define RECOVER_BY_PHASE 0
#endif

#define NT 2                    /* tasks */
#define DA 0                    /* database A, the source */
#define DB 1                    /* database B, the destination */
#define I(d, t) ((d) * NT + (t))

/* ---- each database: shardrun_placement of N ---- */
#define PL_NONE  0              /* no row: never held */
#define HELD     1
#define LEAVING  2              /* peer B */
#define ARRIVING 3              /* peer A */
#define GONE     4              /* peer B */
byte pl[2];
bool mv[2];                     /* shard_fences.moving of N's fence rows */
/* N's fence rows exist while the placement is held, leaving or arriving
 * (copied with the tasks, deleted by the commit and by a recovery) */
#define FENCED(d) (pl[d] == HELD || pl[d] == LEAVING || pl[d] == ARRIVING)
byte fe[2];                     /* their epoch (the runner's is 1; RAISE: the new owner's 2) */
/* the runner's epoch holds the fence at d */
#define HOLDS(d) (FENCED(d) && fe[d] == 1)

/* ---- each database: the task rows of N ---- */
#define ABSENT    0             /* no record */
#define READY     1             /* its lane entry (task_ready) */
#define CLAIMED   2             /* its claim row (task_claims), attempt att */
#define COMPLETED 3
byte ts[4];                     /* [I(d, t)] */
byte att[4];                    /* tasks.attempt */
bool mk[4];                     /* the claim row's completion mark (CompleteTx), committed */
byte lk[4];                     /* the claim row's lock: who holds it */
#define FREE 0
#define COPY(i) (1 + (i))       /* driver i's copy transaction (FOR UPDATE) */
#define SESS 3                  /* the handler's transaction (CompleteTx) */

/* The authoritative copy: A until A's N is gone, then B. */
#define AUTH (pl[DA] == GONE)     /* 0: A, 1: B */

/* ---- etcd ---- */
byte emap;                      /* the map: N -> A or B */
#define PH_NONE     0           /* no move asked yet */
#define PH_LEAVING  1           /* moves[N] = {A, B, leaving} */
#define PH_SWITCHED 2           /* moves[N] = {A, B, switched} */
#define PH_DONE     3           /* moves[N] removed, moved */
#define PH_ROLLED   4           /* moves[N] removed, rolled back */
byte phase;
byte mrev;                      /* the revision the CASes compare */

/* ---- the producer ---- */
#define PR_IDLE 0
#define PR_OPEN 1               /* inserted, not committed: holds the shared lock */
#define PR_DONE 2
byte pst, pdb, pmap = DA, psnap;
#define PLOCKED(d) (!NO_PRODUCER_LOCK && pst == PR_OPEN && pdb == (d))

/* ---- the runner ---- */
#define R_IDLE 0
#define R_RUN  1                /* the handler runs */
#define R_TX   2                /* its transaction holds the mark, open */
#define R_OK   3                /* returned nil: Complete to write */
#define R_ERR  4                /* returned an error: Fail to write */
byte rmap = DA;                 /* the map as the runner last read it */
byte rt[2], ra[2], txdb[2];     /* per task: state, attempt, the transaction's database */
#define CLAIM_IS(d, t) (ts[I(d, t)] == CLAIMED && att[I(d, t)] == ra[t])

/* ---- the drivers ---- */
byte crashes;
bool zombied;                   /* driver 0 paused, driver 1 started */
bool aopen[2];                  /* driver i's copy transaction at A is open */
byte copyread;                  /* open copy transactions that have read A */
byte cf[2] = 1;                 /* each database's coordinator fence (LEADER_FENCE) */
byte leader;                    /* the driver whose term the leader key is (ZOMBIE) */
bool dend;                      /* the driver finished (moved, rolled back, or the move never began) */

/* ---- the specification's own bookkeeping ---- */
bool acked[2];                  /* its producer's commit acknowledged the task */
bool succ[2];                   /* a run of the task succeeded (returned nil, or its CompleteTx committed) */
bool rec[2];                    /* its success is recorded (Complete applied, or the mark committed) */
bool raised;                    /* RAISE: the new owner's raise committed */

/* The properties, named for spin's messages; true between steps. */
bool NoLoss = true, NoDoubleRun = true, NoClaimAfterCopy = true, OneOutcome = true,
     ProducerNeverWritesAtAAfterLeave = true, NoStaleWrite = true, EndsSettled = true;

/* EndsSettled, where the intent is removed: done, A's N gone and B's held,
 * not moving; rolled back, A's N held, not moving, and no copy at B. */
inline settled(c) {
#ifndef NO_SETTLED_CHECK
	EndsSettled = (c); assert(EndsSettled)
#else
	skip
#endif
}

/* NoStaleWrite (RAISE), where the old owner's claim or write lands: not
 * after the new owner's raise committed. */
inline fresh() {
	NoStaleWrite = !raised; assert(NoStaleWrite)
}

/* --------------------------------------------------------------- narration
 * printf is not run by the search; it narrates counterexamples (spin -t). */

inline say_db(d) {
	if
	:: pl[d] == PL_NONE -> printf("none")
	:: pl[d] == HELD -> printf("held")
	:: pl[d] == LEAVING -> printf("leaving")
	:: pl[d] == ARRIVING -> printf("arriving")
	:: else -> printf("gone")
	fi;
	if :: FENCED(d) && mv[d] -> printf(" (moving)") :: else fi;
	if :: RAISE && FENCED(d) -> printf(" e%d", fe[d]) :: else fi
}

inline say_task(d, t) {
	printf(" t%d ", t);
	if
	:: ts[I(d, t)] == ABSENT -> printf("-")
	:: ts[I(d, t)] == READY -> printf("ready")
	:: ts[I(d, t)] == CLAIMED -> printf("claimed(%d)", att[I(d, t)])
	:: else -> printf("completed")
	fi;
	if :: mk[I(d, t)] -> printf("+mark") :: else fi;
	if
	:: lk[I(d, t)] == SESS -> printf("[handler tx]")
	:: lk[I(d, t)] == COPY(0) -> printf("[copy]")
	:: lk[I(d, t)] == COPY(1) -> printf("[copy']")
	:: else
	fi
}

/* The committed state, one line. */
inline print_state() {
	printf("      A: "); say_db(DA); say_task(DA, 0); say_task(DA, 1);
	printf(" | B: "); say_db(DB); say_task(DB, 0); say_task(DB, 1);
	printf(" | map %c", 'A' + emap);
	if
	:: phase == PH_LEAVING -> printf(", move leaving")
	:: phase == PH_SWITCHED -> printf(", move switched")
	:: phase == PH_DONE -> printf(", moved")
	:: phase == PH_ROLLED -> printf(", rolled back")
	:: else
	fi;
	printf(" | runner's map %c\n", 'A' + rmap)
}

/* ------------------------------------------------------------- invariants */

/* NoLoss: a task a producer's commit acknowledged is in the authoritative
 * copy (A while A's N is not gone, B once it is). */
#define KEPT(t) (!acked[t] || ts[I(AUTH, t)] != ABSENT)
#define NO_LOSS (KEPT(0) && KEPT(1))
/* OneOutcome, the part checked in every state: a recorded success stays
 * recorded in the authoritative copy (the task completed there, or its
 * claim marked). */
#define STAYS(t) (!rec[t] || ts[I(AUTH, t)] == COMPLETED || (ts[I(AUTH, t)] == CLAIMED && mk[I(AUTH, t)]))
#ifdef NO_OUTCOME_CHECK
#define STAY true
#else
#define STAY (STAYS(0) && STAYS(1))
#endif

proctype monitor() {
end:	atomic { !(NO_LOSS && STAY) ->
		NoLoss = NO_LOSS; assert(NoLoss);
		OneOutcome = STAY; assert(OneOutcome) }
}

/* OneOutcome, where a success is recorded: in the authoritative copy, once. */
inline record(d, t) {
#ifndef NO_OUTCOME_CHECK
	OneOutcome = (d == AUTH && !rec[t]); assert(OneOutcome);
#endif
	rec[t] = true
}

/* -------------------------------------------------------------- producer */

/* The producer's insert of t1 (its trigger: pg_advisory_xact_lock_shared of
 * N's slot, then state = 'held' or "not held here"), its transaction open
 * any number of steps, its commit. Refused, it re-reads the map and retries
 * in a new transaction. */
proctype producer() {
	byte seen;
retry:
#if PRODUCER_RR
	/* the transaction's first statement: its snapshot (the insert may
	 * follow at once: then it is the insert's own) */
	atomic { psnap = pl[pmap]; printf("producer: its transaction's snapshot at %c (N ", 'A' + pmap); say_db(pmap); printf(")\n") }
#endif
	atomic {
#if PRODUCER_RR && !PLACEMENT_FOR_SHARE
		seen = psnap;           /* the trigger reads the snapshot */
#else
		seen = pl[pmap];        /* the row as committed (READ COMMITTED, or FOR SHARE) */
#endif
		if
		:: seen == HELD && (!PRODUCER_RR || !PLACEMENT_FOR_SHARE || psnap == pl[pmap]) ->
			pst = PR_OPEN; pdb = pmap;
			printf("producer: inserts t1 at %c (N held", 'A' + pdb);
			if :: NO_PRODUCER_LOCK -> printf(", no lock") :: else -> printf(", the shared lock of N's slot") fi;
			printf("), its transaction open\n")
		:: else ->
			printf("producer: refused at %c: ", 'A' + pmap);
			if
			:: PRODUCER_RR && PLACEMENT_FOR_SHARE && seen == HELD -> printf("serialization failure (the placement row changed since its snapshot)")
			:: else -> printf("not held here (N "); say_db(pmap); printf(")")
			fi;
			pmap = emap; psnap = 0; seen = 0;
			printf("; re-reads the map: %c\n", 'A' + pmap)
		fi }
	if
	:: pst == PR_IDLE -> goto retry
	:: else
	fi;
	atomic {
		ts[I(pdb, 1)] = READY; att[I(pdb, 1)] = 0; acked[1] = true;
		printf("producer: commits t1 at %c\n", 'A' + pdb);
#ifndef NO_PRODUCER_CHECK
		ProducerNeverWritesAtAAfterLeave = (pl[pdb] == HELD); assert(ProducerNeverWritesAtAAfterLeave);
#endif
		pst = PR_DONE; seen = 0; psnap = 0;
		print_state() }
}

/* ----------------------------------------------------------------- runner */

/* Claim t at the runner's database: one statement; the fence row FOR
 * SHARE must be there with moving = false; the handler starts. */
inline claim(t) {
	atomic { rt[t] == R_IDLE && HOLDS(rmap) && !mv[rmap] && ts[I(rmap, t)] == READY && att[I(rmap, t)] < MAXATT ->
		ts[I(rmap, t)] = CLAIMED; att[I(rmap, t)]++; ra[t] = att[I(rmap, t)]; rt[t] = R_RUN;
		printf("runner: claims t%d at %c (attempt %d), its handler starts\n", t, 'A' + rmap, ra[t]);
#ifndef NO_RUN_CHECK
		NoDoubleRun = !succ[t]; assert(NoDoubleRun);
#endif
#ifndef NO_CLAIM_CHECK
		NoClaimAfterCopy = (rmap != DA || (copyread == 0 && pl[DA] != GONE)); assert(NoClaimAfterCopy);
#endif
		fresh();
		print_state() }
}

/* The handler returns nil (its effects are done). */
inline succeed(t) {
	atomic { rt[t] == R_RUN -> succ[t] = true; rt[t] = R_OK;
		printf("runner: the handler of t%d returns nil\n", t) }
}

/* CompleteTx in the handler's transaction, at the runner's database: an
 * UPDATE of the claim row (waits for a lock another transaction holds),
 * fenced; no claim there: refused (moved, fence lost, moved on) and the
 * handler's transaction rolls back: the handler returns the error. */
inline mark(t) {
	if
	:: atomic { rt[t] == R_RUN && HOLDS(rmap) && CLAIM_IS(rmap, t) && lk[I(rmap, t)] == FREE ->
		lk[I(rmap, t)] = SESS; txdb[t] = rmap; rt[t] = R_TX;
		printf("runner: the handler of t%d marks its claim at %c (CompleteTx), its transaction open\n", t, 'A' + rmap);
		fresh() }
	:: atomic { rt[t] == R_RUN && !(HOLDS(rmap) && CLAIM_IS(rmap, t)) -> rt[t] = R_ERR;
		printf("runner: the handler of t%d: CompleteTx at %c refused (", t, 'A' + rmap);
		if
		:: pl[rmap] == GONE -> printf("moved")
		:: !HOLDS(rmap) -> printf("ownership lost")
		:: else -> printf("moved on")
		fi;
		printf("), its transaction rolls back, the handler returns the error\n") }
	fi
}

/* The handler's transaction commits: the mark, its effects. */
inline txcommit(t) {
	atomic { rt[t] == R_TX ->
		mk[I(txdb[t], t)] = true; lk[I(txdb[t], t)] = FREE;
		printf("runner: the handler's transaction of t%d commits at %c, the mark with it\n", t, 'A' + txdb[t]);
		record(txdb[t], t);
		succ[t] = true; rt[t] = R_OK; txdb[t] = 0;
		print_state() }
}

/* The runner's write of the outcome (Complete, or Fail), at its database:
 * the claim row matched on the attempt, FOR UPDATE SKIP LOCKED: a held
 * row is Busy (not written: no step, written again later); no claim at a
 * gone shard is Busy too (written again once the runner's map moves on);
 * otherwise classify: the fence not the runner's epoch (or no fence),
 * FenceLost (the runner stops working on the attempt); a completion
 * recorded, Completed; else TaskMoved. */
inline write(t) {
	if
	:: atomic { (rt[t] == R_OK || rt[t] == R_ERR) && HOLDS(rmap) && CLAIM_IS(rmap, t) && lk[I(rmap, t)] == FREE ->
		if
		:: rt[t] == R_OK && mk[I(rmap, t)] ->
			printf("runner: Complete of t%d at %c: Completed (marked)\n", t, 'A' + rmap);
			ts[I(rmap, t)] = COMPLETED
		:: rt[t] == R_OK && !mk[I(rmap, t)] ->
			printf("runner: Complete of t%d at %c applied\n", t, 'A' + rmap);
			record(rmap, t);
			ts[I(rmap, t)] = COMPLETED
		:: rt[t] == R_ERR ->
			printf("runner: Fail of t%d at %c applied: ready again\n", t, 'A' + rmap);
			ts[I(rmap, t)] = READY
		fi;
		mk[I(rmap, t)] = false; rt[t] = R_IDLE; ra[t] = 0;
		print_state();
		fresh() }
#if GONE_IS_FENCE_LOST
	:: atomic { (rt[t] == R_OK || rt[t] == R_ERR) && pl[rmap] == GONE ->
		printf("runner: write of t%d at %c: no claim, the shard gone: taken as fence lost: the attempt is abandoned\n", t, 'A' + rmap);
		rt[t] = R_IDLE; ra[t] = 0 }
#endif
	:: atomic { (rt[t] == R_OK || rt[t] == R_ERR) && pl[rmap] != GONE && !HOLDS(rmap) ->
		printf("runner: write of t%d at %c: FenceLost: the attempt is abandoned\n", t, 'A' + rmap);
		rt[t] = R_IDLE; ra[t] = 0 }
	:: atomic { (rt[t] == R_OK || rt[t] == R_ERR) && HOLDS(rmap) && !CLAIM_IS(rmap, t) ->
		if
		:: ts[I(rmap, t)] == COMPLETED && att[I(rmap, t)] == ra[t] ->
			printf("runner: write of t%d at %c: Completed already\n", t, 'A' + rmap)
		:: else ->
			printf("runner: write of t%d at %c: TaskMoved: the outcome is dropped\n", t, 'A' + rmap)
		fi;
		rt[t] = R_IDLE; ra[t] = 0 }
	fi
}

proctype runner() {
end:
	do
	:: claim(0)
	:: claim(1)
	:: succeed(0)
	:: succeed(1)
#if TX
	:: mark(0)
	:: mark(1)
	:: txcommit(0)
	:: txcommit(1)
#endif
	:: write(0)
	:: write(1)
	od
}

/* The runner's view of the map: some time after each change. */
proctype watch() {
end:
	do
	:: atomic { rmap != emap -> rmap = emap; printf("runner: its map now says N -> %c\n", 'A' + rmap) }
	od
}

/* ---------------------------------------------------------------- sweeper */

/* A claim whose runner no longer works on that attempt (it abandoned it,
 * or believes it finished) is requeued where N is held: the stale sweep
 * (SKIP LOCKED), or the next owner's raise; a marked claim completes. */
#define ORPHAN(d, t) (ts[I(d, t)] == CLAIMED && lk[I(d, t)] == FREE && pl[d] == HELD && \
	!(rt[t] != R_IDLE && ra[t] == att[I(d, t)]))
inline sweep(d, t) {
	atomic { ORPHAN(d, t) ->
		if
		:: mk[I(d, t)] -> ts[I(d, t)] = COMPLETED
		:: else -> ts[I(d, t)] = READY
		fi;
		mk[I(d, t)] = false;
		printf("sweeper: requeues t%d's claim at %c (its runner no longer works on it)\n", t, 'A' + d);
		print_state() }
}

proctype sweeper() {
end:
	do
	:: sweep(DA, 0)
	:: sweep(DA, 1)
	:: sweep(DB, 0)
	:: sweep(DB, 1)
	od
}

/* ------------------------------------------------------------- new owner */

/* RAISE: the new owner's raise, where its map says (read when it
 * acquired): the fence rows upserted at epoch 2 (moving kept), the older
 * epoch's claims requeued, SKIP LOCKED (a locked one is left to
 * RequeueOrphans: the sweeper). At a database where N is gone, or has no
 * row: refused "moved"; it re-reads the map and raises again. With
 * COPY_LOCKS_FENCE the copy's transaction holds A's fence rows. */
#if COPY_LOCKS_FENCE
#define FENCE_FREE(d) ((d) != DA || (!aopen[0] && !aopen[1]))
#else
#define FENCE_FREE(d) true
#endif
inline requeue(d, t) {
	if
	:: ts[I(d, t)] == CLAIMED && lk[I(d, t)] == FREE ->
		if :: mk[I(d, t)] -> ts[I(d, t)] = COMPLETED :: else -> ts[I(d, t)] = READY fi;
		mk[I(d, t)] = false
	:: else
	fi
}

proctype newowner() {
	byte m;
	atomic { m = emap; printf("new owner: acquires N (epoch 2); its map says N -> %c\n", 'A' + m) };
again:
	if
	:: atomic { !FENCED(m) -> printf("new owner: raise at %c refused (moved); re-reads the map\n", 'A' + m); m = emap }; goto again
	:: atomic { FENCED(m) && FENCE_FREE(m) ->
		fe[m] = 2; raised = true; requeue(m, 0); requeue(m, 1);
		printf("new owner: raises the fence of N at %c to epoch 2, requeues the older claims not locked\n", 'A' + m);
		print_state() }
	fi
}

/* ----------------------------------------------------------------- driver */

/* What driver me's copy read, forgotten. */
inline forget(me) {
	cfe[me] = 0;
	cts[I(me, 0)] = 0; cts[I(me, 1)] = 0; catt[I(me, 0)] = 0; catt[I(me, 1)] = 0;
	cmk[I(me, 0)] = false; cmk[I(me, 1)] = false
}

/* Driver me's open copy transaction at A aborts: its locks go. */
inline abort_tx(me) {
	if :: lk[I(DA, 0)] == COPY(me) -> lk[I(DA, 0)] = FREE :: else fi;
	if :: lk[I(DA, 1)] == COPY(me) -> lk[I(DA, 1)] = FREE :: else fi;
	if :: aopen[me] -> aopen[me] = false; copyread-- :: else fi;
	forget(me)
}

/* Every step of the driver may instead: crash (its transactions abort; a
 * new driver recovers); with ZOMBIE, driver 0 may pause once after the
 * intent (a new leader's driver 1 starts; 0 goes on later), and once paused
 * its transaction may be ended by the server, and it stops. */
#define FAULTS(l) \
	:: atomic { crashes < CRASHES && !(me == 0 && zombied) -> crashes++; abort_tx(me); \
		printf("driver %d: crashes; a new driver recovers\n", me) }; goto recover \
	:: atomic { ZOMBIE && me == 0 && !zombied && phase != PH_NONE -> zombied = true; leader = 1; \
		printf("driver 0: pauses (its transaction open); a new leader's driver 1 starts\n"); run driver(1) }; goto l \
	:: atomic { me == 0 && zombied -> abort_tx(me); \
		printf("driver 0: its session ends (it stops)\n") }; goto stop

/* An etcd step of driver me: a CAS on the revision it read (and, with
 * LEADER_FENCE unless ETCD_CAS_ONLY, on the leader key: me the leader);
 * the CAS failing, it re-reads (recovery). */
#define ELEADS (!LEADER_FENCE || ETCD_CAS_ONLY || leader == me)
#define CAS (ELEADS && mrev == myrev)
#define CAS_FAILS (ELEADS && mrev != myrev)
#define ETCD_REFUSED \
	:: atomic { !ELEADS -> printf("driver %d: etcd refuses: the leader key is a newer leader's\n", me) }; goto stop

/* A statement of driver me in database d, under the coordinator fence. */
#define FOK(d) (!LEADER_FENCE || cf[d] == me + 1)
#define REFUSED(d) \
	:: atomic { !FOK(d) -> printf("driver %d: refused at %c: the coordinator fence holds a newer leader\n", me, 'A' + (d)) }; goto stop

/* The copy transaction's claim locks: every claim row of N at A, FOR
 * UPDATE (waits for a runner's write and a handler's transaction). */
#if COPY_WITHOUT_CLAIM_LOCKS
#define LOCKABLE(t) true
#define TAKE(t, me) skip
#else
#define LOCKABLE(t) (ts[I(DA, t)] != CLAIMED || lk[I(DA, t)] == FREE || lk[I(DA, t)] == COPY(me))
#define TAKE(t, me) if :: ts[I(DA, t)] == CLAIMED -> lk[I(DA, t)] = COPY(me) :: else fi
#endif

/* A row step 4 deletes without waiting: unlocked, or locked by its own transaction. */
#define MINE(t) (lk[I(DA, t)] == FREE || lk[I(DA, t)] == COPY(me))

/* Where recovery resumes: the leave (idempotent), or the copy. */
#if RESUME_AT_COPY
#define RESUME s3
#else
#define RESUME s2
#endif

/* Recovery: committed (A's N gone), or not. */
#if RECOVER_BY_PHASE
#define COMMITTED (phase == PH_SWITCHED)
#else
#define COMMITTED (pl[DA] == GONE)
#endif

byte cts[4], catt[4];           /* what driver i's copy read: [I(i, t)] */
bool cmk[4];
byte cfe[2];                    /* ... and the fence's epoch */

proctype driver(byte me) {
	byte myrev;
	if
	:: me == 0 -> goto s1
	:: else -> goto recover
	fi;

	/* 1. intent (etcd): moves[N] = {A, B, leaving}, CAS on the map's revision */
s1:	if
	FAULTS(s1)
	:: atomic { phase == PH_NONE -> phase = PH_LEAVING; mrev++; myrev = mrev;
		printf("driver %d: 1. intent: moves[N] = {A -> B, leaving}\n", me); print_state() }
	fi;

	/* 2. leave (A): try the exclusive advisory lock of N's slot (never
	 * waits: held shared by a producer's transaction, try again later),
	 * placement leaving, fence rows moving; one transaction */
s2:	if
	FAULTS(s2)
	REFUSED(DA)
	:: atomic { FOK(DA) && !PLOCKED(DA) && (pl[DA] == HELD || pl[DA] == LEAVING) ->
		pl[DA] = LEAVING;
#if !NO_MOVING_FENCE
		mv[DA] = true;
#endif
		printf("driver %d: 2. leave: A's N leaving", me);
		if :: NO_MOVING_FENCE -> printf(", fences not moving\n") :: else -> printf(", fences moving\n") fi;
		print_state() }
	:: atomic { FOK(DA) && pl[DA] == GONE -> printf("driver %d: 2. leave: A's N is gone already\n", me) }; goto recover
	fi;

	/* 3. copy: at A, a transaction that locks the claim rows of N and
	 * reads N (it stays open: step 4 is its commit) */
s3:	if
	FAULTS(s3)
	REFUSED(DA)
	:: atomic { FOK(DA) && LOCKABLE(0) && LOCKABLE(1) ->
		TAKE(0, me); TAKE(1, me);
		aopen[me] = true; copyread++;
		cts[I(me, 0)] = ts[I(DA, 0)]; catt[I(me, 0)] = att[I(DA, 0)]; cmk[I(me, 0)] = mk[I(DA, 0)];
		cts[I(me, 1)] = ts[I(DA, 1)]; catt[I(me, 1)] = att[I(DA, 1)]; cmk[I(me, 1)] = mk[I(DA, 1)];
		cfe[me] = fe[DA];
		if
		:: COPY_WITHOUT_CLAIM_LOCKS -> printf("driver %d: 3. copy: reads N at A, its claims not locked\n", me)
		:: else -> printf("driver %d: 3. copy: locks A's claims of N, reads N at A\n", me)
		fi;
		print_state() }
	fi;
	/* ... and in one transaction at B: delete whatever of N is there,
	 * insert the copy (fences moving), placement arriving */
s3b:	if
	FAULTS(s3b)
	REFUSED(DB)
	:: atomic { FOK(DB) && lk[I(DB, 0)] == FREE && lk[I(DB, 1)] == FREE ->
		ts[I(DB, 0)] = cts[I(me, 0)]; att[I(DB, 0)] = catt[I(me, 0)]; mk[I(DB, 0)] = cmk[I(me, 0)];
		ts[I(DB, 1)] = cts[I(me, 1)]; att[I(DB, 1)] = catt[I(me, 1)]; mk[I(DB, 1)] = cmk[I(me, 1)];
		pl[DB] = ARRIVING; mv[DB] = true; fe[DB] = cfe[me];
		printf("driver %d: 3. copy: B's copy committed, B's N arriving\n", me); print_state() }
	fi;
#if SWITCH_BEFORE_COMMIT
	goto s5;
#endif

	/* 4. commit (A, the copy's transaction): delete every row of N (a
	 * row another transaction locks is waited for), placement gone */
s4:	if
	FAULTS(s4)
	:: atomic { aopen[me] && MINE(0) && MINE(1) ->
		ts[I(DA, 0)] = ABSENT; att[I(DA, 0)] = 0; mk[I(DA, 0)] = false; lk[I(DA, 0)] = FREE;
		ts[I(DA, 1)] = ABSENT; att[I(DA, 1)] = 0; mk[I(DA, 1)] = false; lk[I(DA, 1)] = FREE;
		pl[DA] = GONE; mv[DA] = false; fe[DA] = 0;
		aopen[me] = false; copyread--; forget(me);
		printf("driver %d: 4. commit: A's rows of N deleted, A's N gone (the commit point)\n", me); print_state() }
	fi;
#if SWITCH_BEFORE_COMMIT
	goto s6;
#endif

	/* 5. switch (etcd): the map says N -> B, phase switched */
s5:	if
	FAULTS(s5)
	ETCD_REFUSED
	:: atomic { CAS && phase == PH_LEAVING -> emap = DB; phase = PH_SWITCHED; mrev++; myrev = mrev;
		printf("driver %d: 5. switch: the map says N -> B\n", me); print_state() }
	:: atomic { CAS && phase == PH_SWITCHED -> printf("driver %d: 5. switch: switched already\n", me) }
	:: atomic { CAS_FAILS -> printf("driver %d: 5. switch: CAS failed (the move changed): re-reads\n", me) }; goto recover
	fi;
#if SWITCH_BEFORE_COMMIT
	if
	:: aopen[me] -> goto s4
	:: else
	fi;
#endif

	/* 6. arrive (B): placement held, fences moving = false */
s6:	if
	FAULTS(s6)
	REFUSED(DB)
	:: atomic { FOK(DB) ->
		if
		:: pl[DB] == ARRIVING -> pl[DB] = HELD; mv[DB] = false
		:: else
		fi;
		printf("driver %d: 6. arrive: B's N held\n", me); print_state() }
	fi;

	/* 7. done (etcd): moves[N] removed */
s7:	if
	FAULTS(s7)
	ETCD_REFUSED
	:: atomic { CAS -> phase = PH_DONE; mrev++; dend = true;
		printf("driver %d: 7. done\n", me); print_state();
		settled(pl[DA] == GONE && pl[DB] == HELD && !mv[DB]) }; goto stop
	:: atomic { CAS_FAILS -> printf("driver %d: 7. done: CAS failed: re-reads\n", me) }; goto recover
	fi;

	/* Recovery: a new driver (LEADER_FENCE: after raising the fences)
	 * reads the moves and A's placement */
recover:
#if LEADER_FENCE
	if
	:: me == 1 ->
		atomic { !aopen[0] -> cf[DA] = 2; printf("driver 1: raises the coordinator fence at A\n") };
		atomic { cf[DB] = 2; printf("driver 1: raises the coordinator fence at B\n") }
	:: else
	fi;
#endif
	if
	FAULTS(recover)
	:: atomic { phase != PH_LEAVING && phase != PH_SWITCHED -> dend = true;
		printf("driver %d: recovery: no move under way\n", me) }; goto stop
	:: atomic { (phase == PH_LEAVING || phase == PH_SWITCHED) && COMMITTED -> myrev = mrev;
		printf("driver %d: recovery: the move committed: redo 5-7\n", me) }; goto s5
	:: atomic { (phase == PH_LEAVING || phase == PH_SWITCHED) && !COMMITTED -> myrev = mrev;
		printf("driver %d: recovery: not committed (A's N ", me); say_db(DA); printf(")\n") }
	fi;
	/* not committed: B's arriving copy and placement row deleted */
undo:	if
	FAULTS(undo)
	REFUSED(DB)
	:: atomic { FOK(DB) && pl[DB] == ARRIVING && lk[I(DB, 0)] == FREE && lk[I(DB, 1)] == FREE ->
		ts[I(DB, 0)] = ABSENT; att[I(DB, 0)] = 0; mk[I(DB, 0)] = false;
		ts[I(DB, 1)] = ABSENT; att[I(DB, 1)] = 0; mk[I(DB, 1)] = false;
		pl[DB] = PL_NONE; mv[DB] = false; fe[DB] = 0;
		printf("driver %d: recovery: B's copy and placement deleted\n", me); print_state() }
	:: atomic { FOK(DB) && pl[DB] != ARRIVING -> skip }
	fi;
	/* then resume, or roll back */
	if
	:: atomic { true -> printf("driver %d: recovery: resumes\n", me) }; goto RESUME
	:: atomic { true -> printf("driver %d: recovery: rolls back\n", me) }; goto rb
	fi;

	/* roll back (A): placement held, fences moving = false */
rb:	if
	FAULTS(rb)
	REFUSED(DA)
	:: atomic { FOK(DA) && (pl[DA] == HELD || pl[DA] == LEAVING) -> pl[DA] = HELD; mv[DA] = false;
		printf("driver %d: roll back: A's N held again\n", me); print_state() }
	:: atomic { FOK(DA) && pl[DA] == GONE -> printf("driver %d: roll back: A's N is gone\n", me) }; goto recover
	fi;
	/* ... and drop the intent (the map says N -> A) */
rb2:	if
	FAULTS(rb2)
	ETCD_REFUSED
	:: atomic { CAS -> emap = DA; phase = PH_ROLLED; mrev++; dend = true;
		printf("driver %d: roll back: moves[N] removed\n", me); print_state();
		settled(pl[DA] == HELD && !mv[DA] && pl[DB] == PL_NONE) }; goto stop
	:: atomic { CAS_FAILS -> printf("driver %d: roll back: CAS failed: re-reads\n", me) }; goto recover
	fi;
stop:
	skip
}

init {
	atomic {
		pl[DA] = HELD; fe[DA] = 1;
		ts[I(DA, 0)] = READY; acked[0] = true;
		printf("start\n"); print_state();
		run monitor(); run producer(); run runner(); run watch(); run sweeper(); run driver(0);
		if :: RAISE -> run newowner() :: else fi
	}
}

/* Progress: the move ends (moved, or rolled back, or never begun), N held
 * by one database, and every task completed there. */
#define SETTLED ((pl[DA] == GONE && pl[DB] == HELD && !mv[DB]) || (pl[DA] == HELD && !mv[DA] && pl[DB] == PL_NONE))
#define ALL_DONE (ts[I(AUTH, 0)] == COMPLETED && ts[I(AUTH, 1)] == COMPLETED)
ltl Progress { <> (dend && phase != PH_LEAVING && phase != PH_SWITCHED && SETTLED && ALL_DONE) }

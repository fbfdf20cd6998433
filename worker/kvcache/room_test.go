package kvcache

import (
	"testing"
	"time"
)

// MakeRoom's ladder, one move per call, on cells that park: evict an
// unparked idle entry; a returning (parked) request waits while the rest
// steps; the newest request holding cells in the cache swaps out, or is
// preempted when it cannot; a request alone that still does not fit gets
// RoomNone.
func TestMakeRoomTakesOneStepOfTheLadderAtATime(t *testing.T) {
	f, cells := newParkingFixture(t)
	at := func(s int) time.Time { return time.Unix(int64(s), 0) }
	write := func(id string, toks []int) {
		f.bind(id, toks)
		f.write(id, toks, 0, len(toks))
	}
	old, mid, young := vt(40, 1), vt(40, 60), vt(40, 120)
	write("old", old)
	write("mid", mid)
	write("young", young)
	idle := vt(40, 180)
	write("idle", idle)
	f.o.Finish("idle")
	delete(cells.parked, f.mustSeq("idle")) // left in the cache (the park bound was full)
	running := []Holder{{ID: "old", Admitted: at(1), Steps: true}, {ID: "mid", Admitted: at(2), Steps: true}, {ID: "young", Admitted: at(3), Steps: true}}

	if r := f.o.MakeRoom([]string{"old", "mid"}, running); r.Action != RoomEvicted || f.o.Holds("idle") {
		t.Fatalf("first move %+v, idle held %v; want the idle entry evicted", r, f.o.Holds("idle"))
	}
	f.check()
	// Nothing idle left: the newest holding cells in the cache gives them up.
	if r := f.o.MakeRoom([]string{"old", "mid"}, running); r != (Room{Action: RoomSwapped, ID: "young"}) || !cells.Parked(f.mustSeq("young")) {
		t.Fatalf("second move %+v; want young swapped out", r)
	}
	f.check()
	// young, parked, steps again beside old: it waits, old goes on.
	running[2].Steps = false
	if r := f.o.MakeRoom([]string{"old", "young"}, running); r != (Room{Action: RoomWait, ID: "young"}) {
		t.Fatalf("returning beside others: %+v; want young to wait", r)
	}
	// Alone and returning, with an older request still stepping: it waits for it.
	if r := f.o.MakeRoom([]string{"young"}, running); r != (Room{Action: RoomWait, ID: "young"}) {
		t.Fatalf("returning alone: %+v; want young to wait for the older ones", r)
	}
	// Cells that cannot park: the newest is preempted instead.
	h := newFixture(t, 4)
	for _, id := range []string{"a", "b"} {
		toks := vt(40, map[string]int{"a": 1, "b": 60}[id])
		h.bind(id, toks)
		h.write(id, toks, 0, len(toks))
	}
	if r := h.o.MakeRoom([]string{"a"}, []Holder{{ID: "a", Admitted: at(1), Steps: true}, {ID: "b", Admitted: at(2), Steps: true}}); r != (Room{Action: RoomPreempt, ID: "b"}) {
		t.Fatalf("without parking: %+v; want b preempted", r)
	}
	// One request alone holding the only cells: nothing can make room.
	g, _ := newParkingFixture(t)
	lone := vt(40, 7)
	g.bind("lone", lone)
	g.write("lone", lone, 0, len(lone))
	if r := g.o.MakeRoom([]string{"lone"}, []Holder{{ID: "lone", Admitted: at(1), Steps: true}}); r != (Room{Action: RoomNone, ID: "lone"}) {
		t.Fatalf("alone: %+v; want RoomNone", r)
	}
}

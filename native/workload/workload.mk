# The test workload, as an executable and as a library (entry gh_workload_main). Linked against
# the fake libnccl.so.2 (NEEDED, like libtorch_cuda.so) so an LD_PRELOAD hook interposes its calls;
# RUNPATH $ORIGIN/fake finds the fakes, LD_LIBRARY_PATH still overrides it. gh_workload_static has
# the CUDA runtime compiled in (nvcc's default, -cudart static): no libcudart is loaded, only the
# driver, libcuda.so.1.
BUILD ?= build
CC ?= cc
WL_CFLAGS = $(or $(CFLAGS_COMMON),-O2 -Wall -Wextra -Werror) -std=c11 -fPIC -fvisibility=hidden \
            -D_GNU_SOURCE -Iinclude
WL_SRC := workload/workload.c workload/watchdog.c fake/fk_faults.c
WL_HDRS := include/nccl_abi.h workload/watchdog.h fake/fk_faults.h fake/fk_time.h fake/cuda_fake.h
WL_RPATH := -Wl,-rpath,'$$ORIGIN/fake' -Wl,--enable-new-dtags
WL_LIBS := -L$(BUILD)/fake -Wl,--no-as-needed -lnccl -lcublas -lcudart -l:libcuda.so.1 -Wl,--as-needed -lpthread $(WL_RPATH)
WL_STATIC_LIBS := -L$(BUILD)/fake -Wl,--no-as-needed -lnccl -lcublas -l:libcuda.so.1 -Wl,--as-needed -lpthread \
                  $(WL_RPATH)
WL_DEPS := $(BUILD)/fake/libnccl.so $(BUILD)/fake/libcublas.so $(BUILD)/fake/libcudart.so

.PHONY: all-workload clean-workload
all-fake: all-workload
all-workload: $(BUILD)/gh_workload $(BUILD)/libghworkload.so $(BUILD)/gh_workload_static

$(BUILD)/gh_workload: workload/main.c $(WL_SRC) $(WL_HDRS) $(WL_DEPS)
	@mkdir -p $(@D)
	$(CC) $(WL_CFLAGS) -o $@ workload/main.c $(WL_SRC) $(WL_LIBS)

$(BUILD)/gh_workload_static: workload/main.c $(WL_SRC) fake/cudart.c $(WL_HDRS) fake/gpu.h $(WL_DEPS)
	@mkdir -p $(@D)
	$(CC) $(WL_CFLAGS) -Ifake -o $@ workload/main.c $(WL_SRC) fake/cudart.c $(WL_STATIC_LIBS)

$(BUILD)/libghworkload.so: $(WL_SRC) $(WL_HDRS) $(WL_DEPS)
	@mkdir -p $(@D)
	$(CC) $(WL_CFLAGS) -shared -o $@ $(WL_SRC) $(WL_LIBS)

clean-workload:
	rm -f $(BUILD)/gh_workload $(BUILD)/gh_workload_static $(BUILD)/libghworkload.so
